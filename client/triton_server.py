"""Start and stop a real ``tritonserver`` process for serving and integration tests.

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
looking ``python3`` up on ``PATH``; the server is therefore started with this
interpreter's ``bin`` folder first on ``PATH`` so models can import torch & co.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "TritonServerError",
    "TritonServer",
    "find_tritonserver",
    "prepare_backend_dir",
    "free_port",
]

_INSTALL_HINT = (
    "install the server with `pip install --no-deps nvidia-pytriton==0.7.0` "
    "(or `make install`), or put a `tritonserver` on PATH (NVIDIA's tritonserver container)"
)


# glog error lines ("E1123 06:19:42.609405 6023 file.cc:703] ..."), the final
# "error: ..." line, and a C++ abort ("terminate called after throwing ...").
_ERROR_LINE = re.compile(r"^(E\d{4} |error: |terminate called|\s+what\(\): )")
# Name prefix of the python backend's per-stub shared-memory regions in /dev/shm.
_SHM_PREFIX = "triton_python_backend_shm_region_"


class TritonServerError(RuntimeError):
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
        # libraries through LD_LIBRARY_PATH, see _server_env.
        shutil.copy2(src, target / src.name)
    return str(backends)


def free_port(exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port that is free right now (the OS picks it; another process may still race us)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port
    raise TritonServerError("could not find a free TCP port")


def _server_env(executable: str, overrides: dict[str, str | None]) -> dict[str, str]:
    """Environment for the server: bundled libs, this interpreter first on PATH, then overrides."""
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


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class TritonServer:
    """One ``tritonserver`` subprocess in its own process group.

    Ports left at 0 are picked free at every :meth:`start`. By default every
    model in the repository is loaded (``--model-control-mode=none``).
    ``extra_args`` are appended verbatim (e.g. ``["--allow-metrics=false"]``);
    ``env`` entries override the computed environment (``None`` removes a
    variable). stdout and stderr of the server and of python-model stubs go to
    ``log_file`` (default: ``tritonserver.log`` in a temporary workdir).
    ``exit_timeout_s`` sets Triton's own grace period for in-flight requests on
    shutdown (``--exit-timeout-secs``, Triton's default is 30 s).

    Leaving a ``with`` block stops the server and deletes the temporary workdir
    (log included); the end of the log stays available through :meth:`log_tail`.
    """

    model_repository: str | os.PathLike[str]
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    log_file: str | os.PathLike[str] | None = None
    model_control_mode: str = "none"
    exit_timeout_s: int | None = None
    executable: str | None = None
    workdir: str | os.PathLike[str] | None = None

    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _own_workdir: bool = field(default=False, init=False, repr=False)
    _auto_ports: tuple[str, ...] = field(default=(), init=False, repr=False)
    _log_handle: BinaryIO | None = field(default=None, init=False, repr=False)
    _log_start: int = field(default=0, init=False, repr=False)
    _saved_log: str | None = field(default=None, init=False, repr=False)
    _shm_regions: set[str] = field(default_factory=set, init=False, repr=False)

    # --- addresses ---------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``localhost:PORT``, the form tritonclient.http expects."""
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``localhost:PORT``, the form tritonclient.grpc expects."""
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus endpoint (nothing listens there with ``--allow-metrics=false``)."""
        return f"http://localhost:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Server process id (also its process-group id), None before start."""
        return self._proc.pid if self._proc is not None else None

    # --- lifecycle ---------------------------------------------------------
    def command(self, backend_dir: str | None = None) -> list[str]:
        """The command line :meth:`start` runs (with the ports currently set)."""
        exe = self.executable or find_tritonserver()
        cmd = [
            exe,
            f"--model-repository={Path(self.model_repository).resolve()}",
            f"--model-control-mode={self.model_control_mode}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={int(self.log_verbose)}",
        ]
        if self.exit_timeout_s is not None:
            cmd.append(f"--exit-timeout-secs={int(self.exit_timeout_s)}")
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        cmd.extend(self.extra_args)
        return cmd

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Launch the server and block until ``/v2/health/ready`` answers 200.

        Readiness is polled over HTTP, so ``--allow-http=false`` is refused.
        If the process exits first or ``timeout`` passes, the server is stopped
        and :class:`TritonServerError` carries the log's error lines and tail.
        A bind clash on ports we picked ourselves is retried with new ports.
        """
        if self.is_running():
            raise TritonServerError(f"tritonserver already running (pid {self.pid})")
        if any(a.strip().lower() in ("--allow-http=false", "--allow-http=0") for a in self.extra_args):
            raise TritonServerError("readiness is checked over HTTP; do not pass --allow-http=false")
        if not Path(self.model_repository).is_dir():
            raise TritonServerError(f"model repository {self.model_repository} is not a directory")
        self.executable = self.executable or find_tritonserver()

        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="pagedserve-triton-")
            self._own_workdir = True
        workdir = Path(self.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        backend_dir = prepare_backend_dir(workdir, self.executable)
        if self.log_file is None:
            self.log_file = str(workdir / "tritonserver.log")
        Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)

        if not self._auto_ports:
            self._auto_ports = tuple(
                a for a in ("http_port", "grpc_port", "metrics_port") if not getattr(self, a)
            )
        deadline = time.monotonic() + timeout
        attempts = 3 if self._auto_ports else 1
        for attempt in range(attempts):
            self._pick_ports()
            self._launch(backend_dir, workdir)
            try:
                self._wait_ready(deadline)
                return self
            except TritonServerError:
                port_clash = any("already in use" in ln for ln in self.error_lines())
                if attempt + 1 < attempts and port_clash and time.monotonic() < deadline:
                    continue
                raise
        raise AssertionError("unreachable")

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGINT (graceful), wait, then SIGKILL the whole process group and wait.

        ``timeout`` defaults to Triton's exit timeout plus 10 s, so a graceful
        shutdown is not cut short. The group kill also takes python-backend stubs
        a dying server may leave behind, so ports are free when this returns.
        Returns the server's exit code (None if it was never started).
        """
        proc = self._proc
        if proc is None:
            return None
        if timeout is None:
            timeout = float(self.exit_timeout_s if self.exit_timeout_s is not None else 30) + 10.0
        pgid = proc.pid  # start_new_session=True made the server its group leader
        self._shm_regions |= _stub_shm_regions(pgid)
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._shm_regions |= _stub_shm_regions(pgid)
        try:
            os.killpg(pgid, signal.SIGKILL)  # a hung server, or stubs it orphaned
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired as exc:
            raise TritonServerError(f"tritonserver pid {proc.pid} did not exit after SIGKILL") from exc
        _wait_group_gone(pgid, timeout=5.0)
        # A killed stub cannot unlink its shared-memory region; do it for it.
        for region in self._shm_regions:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", region))
        self._shm_regions.clear()
        self._close_log()
        atexit.unregister(self._kill_at_exit)
        return proc.returncode

    def cleanup(self) -> None:
        """Stop if needed and delete the temporary workdir :meth:`start` created.

        The end of the log is kept in memory first, so :meth:`log_tail` and
        :meth:`error_lines` still work afterwards.
        """
        if self.is_running():
            self.stop()
        if self._own_workdir and self.workdir is not None:
            if self.log_file and Path(self.log_file).resolve().is_relative_to(Path(self.workdir).resolve()):
                self._saved_log = self._read_log()
                self.log_file = None
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
            self._own_workdir = False

    def __enter__(self) -> TritonServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def is_running(self) -> bool:
        """True while the server process exists (it may not be ready yet)."""
        return self._proc is not None and self._proc.poll() is None

    # --- readiness ---------------------------------------------------------
    def is_ready(self) -> bool:
        """Server-level readiness (``GET /v2/health/ready`` is 200)."""
        return self.is_running() and http_status(self._http("/v2/health/ready")) == 200

    def wait_model_ready(self, name: str, timeout: float = 60.0, version: str | int | None = None) -> None:
        """Block until ``/v2/models/{name}[/versions/{version}]/ready`` answers 200.

        Useful with ``model_control_mode="explicit"`` or after a reload; with the
        default mode every model is ready once :meth:`start` returns.
        """
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version is not None else "") + "/ready"
        deadline = time.monotonic() + timeout
        while True:
            if not self.is_running():
                raise TritonServerError(f"tritonserver is not running; {self._failure_details()}")
            if http_status(self._http(path)) == 200:
                return
            if time.monotonic() > deadline:
                raise TritonServerError(f"model {name!r} not ready after {timeout:.0f}s; {self._failure_details()}")
            time.sleep(0.25)

    # --- logs --------------------------------------------------------------
    def log_tail(self, n: int = 50) -> str:
        """Last ``n`` lines this run wrote to the log ("" if none)."""
        return "\n".join(deque(self._read_log().splitlines(), maxlen=n))

    def error_lines(self, n: int = 10) -> list[str]:
        """Last ``n`` error lines of this run's log.

        Model-load failures are logged long before the shutdown chatter that
        ends the log, so a plain tail often misses the reason.
        """
        return [ln for ln in self._read_log().splitlines() if _ERROR_LINE.match(ln)][-n:]

    # --- internals ---------------------------------------------------------
    def _http(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def _pick_ports(self) -> None:
        taken = {getattr(self, a) for a in ("http_port", "grpc_port", "metrics_port")} - {0}
        for attr in self._auto_ports:
            taken.discard(getattr(self, attr))
        for attr in self._auto_ports:
            port = free_port(taken)
            taken.add(port)
            setattr(self, attr, port)

    def _launch(self, backend_dir: str | None, workdir: Path) -> None:
        assert self.log_file is not None and self.executable is not None
        self._close_log()
        log = open(self.log_file, "ab", buffering=0)
        self._log_handle = log
        self._log_start = log.tell()
        self._saved_log = None
        try:
            self._proc = subprocess.Popen(
                self.command(backend_dir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(self.executable, self.env),
                cwd=str(workdir),
                start_new_session=True,  # own process group, so stop() can take the stubs too
            )
        except OSError as exc:
            self._close_log()
            raise TritonServerError(f"could not execute {self.executable}: {exc}") from exc
        atexit.register(self._kill_at_exit)

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        url = self._http("/v2/health/ready")
        while True:
            code = self._proc.poll()
            if code is not None:
                self.stop()
                raise TritonServerError(
                    f"tritonserver exited with code {code} before becoming ready; {self._failure_details()}"
                )
            if http_status(url) == 200:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise TritonServerError(f"tritonserver not ready in time; {self._failure_details()}")
            time.sleep(0.25)

    def _failure_details(self) -> str:
        errors = "\n".join(self.error_lines()) or "(none)"
        return f"errors in log {self.log_file}:\n{errors}\nlog ends with:\n{self.log_tail(30)}"

    def _read_log(self, max_bytes: int = 4 * 1024 * 1024) -> str:
        """This run's log text (at most the last ``max_bytes``)."""
        if not self.log_file:
            return self._saved_log or ""
        try:
            with open(self.log_file, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self._log_start, size - max_bytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return self._saved_log or ""

    def _close_log(self) -> None:
        handle, self._log_handle = self._log_handle, None
        if handle is not None:
            handle.close()

    def _kill_at_exit(self) -> None:
        """Never leave a server holding ports when the Python process ends."""
        with contextlib.suppress(Exception):
            self.stop(timeout=5.0)


def _stub_shm_regions(pgid: int) -> set[str]:
    """Shared-memory region names on the command lines of the group's stubs (Linux /proc)."""
    regions: set[str] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return regions
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # Fields after the ")" closing the command name: state ppid pgrp ...
            if int(stat.rsplit(b")", 1)[1].split()[2]) != pgid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for arg in args:
            name = arg.decode(errors="replace")
            if name.startswith(_SHM_PREFIX) and "/" not in name:
                regions.add(name)
    return regions


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait until no process of the group is left (zombies reaped by init count as gone late)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
