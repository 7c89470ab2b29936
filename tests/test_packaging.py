"""The distribution as the image installs it (`pip install .`, not editable): every module of
backend/, kernels/ and client/ is in the wheel, and the installed package, alone on the path
(neither this checkout nor the editable install importable), imports all of them and serves:
a fresh environment holding the wheel (layered on this one's dependencies) runs tritonserver
on a copy of model_repository/ as the image does, and `llm`, `ensemble`, `tensorrt_llm_bls` and
the OpenAI gateway answer. A hand-kept package list once left out
`pagedserve.backend.distributed`, so `llm` could not load in the image (setup.py now finds the
packages)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("backend", "kernels", "client")

IMPORT_ALL = """
import importlib, pkgutil, sys
site = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:] = [site] + [p for p in sys.path if p not in ("", {root!r}) and "__editable__" not in p]
import pagedserve.backend
assert pagedserve.backend.__file__.startswith(site), pagedserve.backend.__file__
names = []
for part in ("backend", "kernels", "client"):
    package = importlib.import_module("pagedserve." + part)
    names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(site), (name, module.__file__)
print(len(names))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of what the image's build stage copies (docker/Dockerfile): built in the
    checkout, setuptools would reuse its build/ folder, where a module moved or deleted since
    the last build still lies, and ship it."""
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for part in PARTS:
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(out)], check=True, capture_output=True, cwd=out)
    return next(out.glob("pagedserve-*.whl"))


SHIPPED = (".py", ".c", ".h", ".json", ".md")
"""Code, the C kernels' sources and the kernel choices tuned per GPU (kernels/triton/configs/)."""


def test_every_module_of_the_tree_is_in_the_wheel(wheel):
    shipped = set(zipfile.ZipFile(wheel).namelist())
    tree = {f"pagedserve/{path.relative_to(ROOT).as_posix()}" for part in PARTS for path in (ROOT / part).rglob("*")
            if path.suffix in SHIPPED and "__pycache__" not in path.parts}
    assert tree - shipped == set()
    modules = {name for name in shipped if name.startswith("pagedserve/") and name.endswith(SHIPPED)}
    assert modules - tree == set()  # nothing the tree no longer has


def test_the_installed_package_alone_imports_every_module(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL.format(root=str(ROOT)), str(site)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) > 50


# Appended to the copy of llm's model.py: the stub says where it imported the engine from.
WHERE_FROM = """
import sys as _sys
import pagedserve.backend as _installed
print("pagedserve imported from", _installed.__file__, file=_sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    """A virtual environment holding the wheel alone, this environment's site-packages after it
    for the dependencies (a plain path line: its editable finder never runs)."""
    env = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-compile",
                    str(wheel)], check=True, capture_output=True)
    return env


def test_the_installed_wheel_serves_every_entry_point(fresh_env, tmp_path):
    from pagedserve.client.process import ServerProcess, free_port, http_status
    from pagedserve.client.triton_server import TritonServer

    from .integration.conftest import llm_inputs, stream_request, texts
    from .integration.test_trtllm_contract import trt_text

    import openai

    repository = tmp_path / "model_repository"
    shutil.copytree(ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("__pycache__"))
    with (repository / "llm" / "1" / "model.py").open("a") as model_py:
        model_py.write(WHERE_FROM)
    bin_dir = str(fresh_env / "bin")
    env = {"PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]), "VIRTUAL_ENV": str(fresh_env), "PYTHONPATH": None}
    log = tmp_path / "server.log"
    with TritonServer(repository, log_file=log, env=env).start(timeout=300) as server:
        where = [line for line in log.read_text().splitlines() if "pagedserve imported from" in line]
        assert where and where[0].split("from ", 1)[1].startswith(str(fresh_env)), where
        results, error = stream_request(server, llm_inputs("The capital of France is", max_tokens=6, temperature=0))
        assert error is None and "".join(texts(results)).strip()
        for model in ("ensemble", "tensorrt_llm_bls"):
            assert "".join(trt_text(server, model, "The capital of France is", 6)).strip()
        port = free_port()
        gateway = ServerProcess([str(fresh_env / "bin" / "pagedserve"), "openai", "--port", str(port),
                                 "--triton-url", server.grpc_url], tmp_path / "gateway.log", name="pagedserve openai",
                                env={**os.environ, **{k: v for k, v in env.items() if v is not None},
                                     "PAGEDSERVE_API_KEY": "wheel-key"}).start()
        try:
            gateway.wait_ready(lambda: http_status(f"http://localhost:{port}/health") == 200, time.monotonic() + 60)
            client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="wheel-key")
            chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
            assert chat.choices[0].message.content
        finally:
            gateway.stop()
