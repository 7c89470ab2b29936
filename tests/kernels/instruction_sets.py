"""What the tests of the C kernels share about instruction sets: whether this CPU runs AVX2
code, and every kernel library rebuilt for another -march (how a machine with AVX-512 runs
what an AVX2-only one would). A plain module (not collected)."""

from __future__ import annotations

import importlib
import platform
import pkgutil

import pytest

from pagedserve import kernels
from pagedserve.backend.device import cpuinfo
from pagedserve.kernels import native_build

for _module in pkgutil.iter_modules(kernels.__path__):
    if _module.name.endswith("_cpu"):  # the C kernels' modules: each makes its NativeLibrary at import
        importlib.import_module(f"{kernels.__name__}.{_module.name}")
LIBRARIES = native_build.LIBRARIES


def runs_avx2() -> bool:
    """An x86 CPU with AVX2 and FMA (gcc's -march=haswell code runs here)."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= set(cpuinfo().split())


def build_every_kernel_for(monkeypatch: pytest.MonkeyPatch, march: str) -> None:
    """From here to the test's end every kernel library loads `march`'s code (built on first use)."""
    monkeypatch.setenv(native_build.MARCH_ENV, march)
    for library in LIBRARIES:
        monkeypatch.setattr(library, "_loaded", [])
