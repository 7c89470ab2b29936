"""What the tests of the C kernels share about instruction sets: the ISA variants of the kernels'
code (VARIANTS), which of them this CPU runs natively, which run emulated by SIMDe (AVX-512 code
on a CPU without it, kernels/cpu/cpu_simde.h), every kernel library rebuilt for one of them, and a
record of the variants the session ran and could not, which tests/conftest.py prints at the end
of the run (`make test`'s "C kernel instruction sets" line). A plain module (not collected).

The kernels have five forms, chosen at compile time by the -march they are built for: AMX (the
bf16 matmul's tiles; otherwise the next form's code), AVX-512 with AVX512-BF16 (bf16 products in
pairs: the matmul, prefill and decode attention), AVX-512 without it, AVX2 and FMA, and plain C
(no vector code: several kernels then decline and torch runs). "native" is the CPU's own code
(-march=native), whichever of them that is. SIMDe cannot stand in for AMX.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import platform
from dataclasses import dataclass

import pytest

from pagedserve.backend.device import cpuinfo
from pagedserve.kernels.cpu import native_build

native_build.build_all()  # imports every C kernel's module (each makes its NativeLibrary), built natively
LIBRARIES = native_build.LIBRARIES

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
"""What the kernels' AVX-512 code needs (masked 16-bit loads: BW and VL)."""


@dataclass(frozen=True)
class Variant:
    name: str
    march: str
    """gcc's -march where the CPU runs it natively"""
    flags: frozenset[str]
    """/proc/cpuinfo flags a CPU needs to run it natively"""
    emulated: str | None = None
    """native_build.EMULATED's name for it, where SIMDe can stand in"""


VARIANTS = (
    Variant("amx", "sapphirerapids", frozenset(AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"})),
    Variant("avx512bf16", "cooperlake", frozenset(AVX512 | {"avx512_bf16"}), "simde-avx512bf16"),
    Variant("avx512", "skylake-avx512", frozenset(AVX512), "simde-avx512"),
    Variant("avx2", "haswell", frozenset({"avx2", "fma"})),
    Variant("x86-64", "x86-64", frozenset()),
)
BY_NAME = {v.name: v for v in VARIANTS}


def cpu_flags() -> set[str]:
    return set(cpuinfo().split())


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def runs_avx2() -> bool:
    """An x86 CPU with AVX2 and FMA (gcc's -march=haswell code runs here)."""
    return is_x86() and {"avx2", "fma"} <= cpu_flags()


def native_variant() -> str | None:
    """The variant the CPU's own code (-march=native) is: the first in VARIANTS it runs."""
    if not is_x86():
        return None
    return next(v.name for v in VARIANTS if v.flags <= cpu_flags())


@functools.cache
def simde_version() -> str | None:
    if native_build.simde_include() is None or native_build.compiler() is None:
        return None
    return importlib.metadata.version("simde-py")


def how_to_run(name: str) -> tuple[str | None, str]:
    """(the march to build `name` with, how: "native" or "emulated by SIMDe x"), or (None, why not)."""
    variant = BY_NAME[name]
    if not is_x86():
        return None, f"not an x86 CPU ({platform.machine()})"
    if native_build.compiler() is None:
        return None, "no C compiler"
    if variant.flags <= cpu_flags():
        return variant.march, "native"
    if variant.emulated and simde_version():
        return variant.emulated, f"emulated by SIMDe {simde_version()}"
    missing = " ".join(sorted(variant.flags - cpu_flags()))
    return None, f"this CPU lacks {missing}" + (" and SIMDe is not installed" if variant.emulated else "")


RAN: dict[str, set[str]] = {}
"""variant -> how it ran ("native", "emulated by SIMDe x") in this session"""
NOT_RUN: dict[str, str] = {}
"""variant -> why a test asked for it and could not run it"""


def record(name: str, how: str) -> None:
    RAN.setdefault(name, set()).add(how)


def build_every_kernel_for(monkeypatch: pytest.MonkeyPatch, march: str) -> None:
    """From here to the test's end every kernel library loads `march`'s code (built on first use)."""
    monkeypatch.setenv(native_build.MARCH_ENV, march)
    for library in LIBRARIES:
        monkeypatch.setattr(library, "_loaded", [])


def march_for(name: str) -> str:
    """The -march (or EMULATED name) that builds variant `name` here, recorded as run; skips the
    test where it cannot run here. For tests that load one library themselves."""
    march, how = how_to_run(name)
    if march is None:
        NOT_RUN.setdefault(name, how)
        pytest.skip(f"{name} code: {how}")
    record(name, how)
    return march


def use_variant(monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """Every kernel library in variant `name`'s code for the rest of the test (skips where it
    cannot run here); returns how it runs. "native": the CPU's own code, as built by default."""
    if name == "native":
        own = native_variant()
        if own is not None:
            record(own, "native")
        return "native"
    if name == native_variant():
        record(name, "native")
        pytest.skip(f"{name} is this CPU's own code: the native case runs it")
    build_every_kernel_for(monkeypatch, march_for(name))
    return RAN[name].copy().pop()


def summary() -> str | None:
    """One line: the variants this session ran (and how) and those it could not; None where no
    test asked for any."""
    if not RAN and not NOT_RUN:
        return None
    ran = ", ".join(f"{name} ({' and '.join(sorted(RAN[name]))})" for name in BY_NAME if name in RAN)
    reasons = []
    for name in BY_NAME:
        if name not in RAN:
            march, how = how_to_run(name)
            reasons.append(f"{name} ({NOT_RUN.get(name) or (how if march is None else 'runnable here; no selected test asked for it')})")
    return f"ran {ran or 'none'}" + (f"; not run: {', '.join(reasons)}" if reasons else "")
