"""What the tests of the C kernels share about instruction sets: whether this CPU runs AVX2
code, and every kernel library rebuilt for another -march (how a machine with AVX-512 runs
what an AVX2-only one would). A plain module (not collected)."""

from __future__ import annotations

import platform

import pytest

from pagedserve.backend.device import cpuinfo
from pagedserve.kernels import (bf16_matmul_cpu, block_matmul_cpu, cache_write_cpu, decoder_stack_cpu, first_max_cpu,
                                gemv_cpu, native_build, paged_decode_cpu, paged_prefill_cpu, rms_norm_cpu, rotary_cpu,
                                silu_mul_cpu)

LIBRARIES = [module.LIBRARY for module in (bf16_matmul_cpu, block_matmul_cpu, cache_write_cpu, decoder_stack_cpu,
                                           first_max_cpu, gemv_cpu, paged_decode_cpu, paged_prefill_cpu, rms_norm_cpu,
                                           rotary_cpu, silu_mul_cpu)]


def runs_avx2() -> bool:
    """An x86 CPU with AVX2 and FMA (gcc's -march=haswell code runs here)."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= set(cpuinfo().split())


def build_every_kernel_for(monkeypatch: pytest.MonkeyPatch, march: str) -> None:
    """From here to the test's end every kernel library loads `march`'s code (built on first use)."""
    monkeypatch.setenv(native_build.MARCH_ENV, march)
    for library in LIBRARIES:
        monkeypatch.setattr(library, "_loaded", [])
