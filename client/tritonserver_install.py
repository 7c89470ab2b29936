"""Find a ``tritonserver`` binary and give it what it needs to run our models.

Two kinds of server are supported:

* a ``tritonserver`` found on ``PATH`` (NVIDIA's container): it ships its own
  backends under ``/opt/tritonserver/backends`` and needs no help;
* the server bundled in the ``nvidia-pytriton`` wheel, which we use on machines
  without the container. That wheel keeps the python backend library and the
  per-Python-version stubs in separate folders, so Triton cannot find them as a
  backend; :func:`prepare_backend_dir` assembles a backend directory for it.

The wheel's binaries locate their bundled libraries through relative RPATHs, so a
stub copied elsewhere needs ``LD_LIBRARY_PATH`` to point at ``nvidia_pytriton.libs``.
The stub embeds Python and picks its interpreter (and so ``site-packages``) by
looking ``python3`` up on ``PATH``; :func:`server_env` therefore puts this
interpreter's ``bin`` folder first on ``PATH`` so models can import torch & co.
That wheel's python backend predates numpy 2 support, so :func:`check_stub_numpy` refuses
an environment with numpy 2 before the server starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from .process import ServerProcessError

__all__ = ["TritonServerError", "check_stub_numpy", "find_tritonserver", "prepare_backend_dir", "server_env"]

_INSTALL_HINT = (
    "install the server with `pip install --no-deps nvidia-pytriton==0.7.0` "
    "(or `make install`), or put a `tritonserver` on PATH (NVIDIA's tritonserver container)"
)


class TritonServerError(ServerProcessError):
    """The server could not be found, started or stopped."""


def _wheel_server_root() -> Path | None:
    """``.../site-packages/pytriton/tritonserver`` of the installed wheel, if any.

    ``find_spec`` locates the package without importing it: pytriton's own
    ``__init__`` needs dependencies we deliberately do not install.
    """
    try:
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        root = Path(location) / "tritonserver"
        if (root / "bin" / "tritonserver").is_file():
            return root
    return None


def _wheel_libs_dir(server_root: Path) -> Path:
    """The wheel's bundled shared libraries (``site-packages/nvidia_pytriton.libs``)."""
    return server_root.parent.parent / "nvidia_pytriton.libs"


def _is_wheel_server(executable: str | os.PathLike[str]) -> bool:
    root = _wheel_server_root()
    if root is None:
        return False
    try:
        return Path(executable).resolve() == (root / "bin" / "tritonserver").resolve()
    except OSError:
        return False


def find_tritonserver() -> str:
    """Path of the ``tritonserver`` to run.

    A ``tritonserver`` on ``PATH`` wins because it comes with its own backends;
    otherwise the one inside the nvidia-pytriton wheel is used.
    """
    on_path = shutil.which("tritonserver")
    if on_path:
        return on_path
    root = _wheel_server_root()
    if root is not None:
        return str(root / "bin" / "tritonserver")
    raise TritonServerError(f"no tritonserver found: {_INSTALL_HINT}")


def prepare_backend_dir(
    workdir: str | os.PathLike[str], tritonserver: str | None = None
) -> str | None:
    """Build ``<workdir>/backends/python/`` for the wheel's server and return ``<workdir>/backends``.

    Returns ``None`` for any other server (it already knows its backends). The
    stub must match the running interpreter's ``major.minor`` because it links
    that libpython and loads this environment's packages.
    """
    exe = tritonserver or find_tritonserver()
    if not _is_wheel_server(exe):
        return None
    root = _wheel_server_root()
    assert root is not None
    check_stub_numpy()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir() if p.is_dir())
        raise TritonServerError(
            f"nvidia-pytriton has no python backend stub for Python {version} "
            f"(available: {', '.join(have) or 'none'}); use one of those Python versions"
        )
    sources = [
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ]
    backends = Path(workdir) / "backends"
    target = backends / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src in sources:
        if not src.is_file():
            raise TritonServerError(f"nvidia-pytriton install is incomplete: missing {src}")
        # Real copies (the verified layout); the copied stub then finds the wheel's
        # libraries through LD_LIBRARY_PATH, see server_env.
        shutil.copy2(src, target / src.name)
    return str(backends)


def check_stub_numpy(numpy_version: str | None = None) -> None:
    """Refuse numpy 2 for the wheel's stub, which embeds this environment's interpreter.

    The wheel's Triton 2.51 python backend was built with a pybind11 that reads numpy 1's
    C layout: under numpy 2 the server loads, then every request's string input reaches
    the model garbled and kills the stub (``unpack_from requires a buffer of at least ...``),
    so the failure would surface only at the first request, far from its cause.
    """
    if numpy_version is None:
        try:
            numpy_version = importlib.metadata.version("numpy")
        except importlib.metadata.PackageNotFoundError:
            return  # the model's own import error will name it
    if int(numpy_version.split(".")[0]) >= 2:
        raise TritonServerError(
            f"numpy {numpy_version} is installed in {sys.prefix}, whose interpreter the bundled "
            "tritonserver's python backend (nvidia-pytriton 0.7.0, Triton 2.51) embeds; that backend "
            "reads tensors wrongly under numpy 2 (each request kills the model's stub). Install "
            "`pip install 'numpy<2'` there (`make install` pins it), or serve with a tritonserver "
            "whose python backend supports numpy 2 (NVIDIA's container, release 24.11 or later)"
        )


def server_env(executable: str, overrides: dict[str, str | None]) -> dict[str, str]:
    """Environment for the server: bundled libs, this interpreter first on PATH, then
    ``overrides`` (``None`` removes a variable)."""
    env = dict(os.environ)
    lib_dirs: list[str] = []
    if _is_wheel_server(executable):
        root = _wheel_server_root()
        assert root is not None
        lib_dirs.append(str(_wheel_libs_dir(root)))
    # The stub links libpython<major.minor>.so; prefer the one of this interpreter
    # (pyenv and similar builds) so stdlib and libpython come from the same build.
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and os.path.isfile(os.path.join(libdir, soname)):
        lib_dirs.append(libdir)
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(lib_dirs))

    # The stub finds its interpreter via `python3` on PATH; make it ours even when
    # the venv was not "activated" (e.g. `.venv/bin/python -m pytest`).
    in_venv = sys.prefix != sys.base_prefix
    bin_dir = os.path.join(sys.prefix, "bin") if in_venv else os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")]) if env.get("PATH") else bin_dir
    if in_venv:
        env["VIRTUAL_ENV"] = sys.prefix
    env.pop("PYTHONHOME", None)

    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
