"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from .instruction_sets import build_every_kernel_for, runs_avx2


@pytest.fixture(params=["native", "haswell"])
def instruction_set(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU's own code, then the AVX2 code an AVX2-only CPU runs (every C kernel rebuilt for it)."""
    if request.param == "haswell":
        if not runs_avx2():
            pytest.skip("this CPU does not run AVX2 code")
        build_every_kernel_for(monkeypatch, "haswell")
    return request.param
