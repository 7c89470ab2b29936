"""Building the C kernels at first use (kernels/cpu/native_build.py): cached on disk, and
every way it can fail leaves torch ops in charge with one warning naming the cause."""

from __future__ import annotations

import logging

import pytest

from pagedserve.kernels.cpu import native_build
from pagedserve.kernels.cpu.first_max import LIBRARY as FIRST_MAX
from pagedserve.kernels.cpu.paged_decode import LIBRARY as DECODE
from pagedserve.kernels.cpu.paged_prefill import LIBRARY as PREFILL
from pagedserve.kernels.cpu.rms_norm import LIBRARY as RMS_NORM
from pagedserve.kernels.cpu.silu_mul import LIBRARY as SILU_MUL


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler here")
@pytest.mark.parametrize("library", [RMS_NORM, FIRST_MAX], ids=["rms_norm_cpu", "first_max_cpu"])
def test_build_is_cached_on_disk(library, tmp_path, monkeypatch):
    """Two small kernels: every kernel takes the same path, and a large one (paged decode)
    compiled 35-50 s of the suite's time on 2 cores for nothing more."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    first = native_build.build(library.source, native_build.compiler())
    assert first.parent == tmp_path / "kernels" and first.name.startswith(library.source.stem)
    stamp = first.stat().st_mtime_ns
    assert native_build.build(library.source, native_build.compiler()) == first and first.stat().st_mtime_ns == stamp
    assert library.load() is not None


def test_no_compiler_a_failed_build_or_switched_off_means_torch_ops(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="pagedserve")
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert DECODE.load() is None
    assert "CPU decode attention: build failed, using the slower torch-op decode" in caplog.text
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert RMS_NORM.load() is None
    assert "CPU RMSNorm: no C compiler (set CC or install gcc); using torch ops" in caplog.text
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    assert DECODE.load() is None and RMS_NORM.load() is None


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler here")
@pytest.mark.parametrize("library", [PREFILL, FIRST_MAX, SILU_MUL], ids=["paged_prefill_cpu", "first_max_cpu", "silu_mul_cpu"])
def test_a_library_without_code_for_the_cpu_is_not_used(library, caplog):
    """Kernels with vector code only (AVX-512 and AVX2) built for an older CPU (plain x86-64)
    load as None (torch runs), once, not declined per call."""
    caplog.set_level(logging.INFO, logger="pagedserve")
    assert library.load(march="x86-64") is None
    assert f"{library.what}: no code for this CPU's instruction set; using {library.fallback}" in caplog.text


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler here")
def test_the_instruction_set_can_be_named(monkeypatch, tmp_path):
    """PAGEDSERVE_CPU_MARCH builds every kernel for that -march (what an older CPU runs)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(native_build.MARCH_ENV, "x86-64")
    assert SILU_MUL.load() is None  # no vector code for plain x86-64
    monkeypatch.delenv(native_build.MARCH_ENV)
    assert RMS_NORM.load() is not None


def test_every_c_kernel_is_rebuilt_when_the_tests_switch_instruction_sets():
    """The AVX2 cases rebuild the libraries `native_build.LIBRARIES` lists: every C source under
    kernels/ is there (a new kernel registers itself by making its NativeLibrary)."""
    from pathlib import Path

    from .instruction_sets import LIBRARIES

    sources = {path.name for path in Path(native_build.__file__).parent.glob("*.c")}
    assert sources and sources <= {library.source.name for library in LIBRARIES}
