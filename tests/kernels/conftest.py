"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from .instruction_sets import use_variant


@pytest.fixture(params=["native", "avx2", "avx512", "avx512bf16"])
def instruction_set(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU's own code, then each other ISA variant of the C kernels (tests/kernels/
    instruction_sets.py) that this CPU runs natively or SIMDe emulates (every C kernel rebuilt
    for it); a variant that is the CPU's own, or that cannot run here, is skipped."""
    use_variant(monkeypatch, request.param)
    return request.param
