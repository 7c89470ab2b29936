"""The distribution as the image installs it (`pip install .`, not editable): every module of
backend/, kernels/ and client/ is in the wheel, and the installed package, alone on the path
(neither this checkout nor the editable install importable), imports all of them. A hand-kept
package list once left out `pagedserve.backend.distributed`, so `llm` could not load in the
image (setup.py now finds the packages)."""

from __future__ import annotations

import os
import subprocess
import sys
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
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(out)], check=True, capture_output=True, cwd=out)
    return next(out.glob("pagedserve-*.whl"))


def test_every_module_of_the_tree_is_in_the_wheel(wheel):
    shipped = set(zipfile.ZipFile(wheel).namelist())
    tree = {f"pagedserve/{path.relative_to(ROOT).as_posix()}" for part in PARTS for path in (ROOT / part).rglob("*")
            if path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts}
    assert tree - shipped == set()


def test_the_installed_package_alone_imports_every_module(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL.format(root=str(ROOT)), str(site)], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) > 50
