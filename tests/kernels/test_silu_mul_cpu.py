"""SiLU(gate) * up in one C pass (kernels/cpu/silu_mul.py) against torch's two ops: within 1e-5
relative (exp by a polynomial, ~2e-7; where exp(-gate) overflows in torch, both are ~0), for
row widths that are not whole vectors; bfloat16 rounded once from the float32 result; the same
in the AVX2 code as in the CPU's own; declined where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.silu_mul import silu_mul

built = pytest.mark.skipif(silu_mul(torch.zeros(1, 32)) is None, reason="the C SiLU needs a C compiler and AVX2 or AVX-512")


@built
@pytest.mark.parametrize("rows, n", [(1, 1536), (7, 40), (300, 1536), (3, 1)])
def test_matches_torch(rows, n, instruction_set):
    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(rows + n)) * 6
    x[0, : min(n, 4)] = torch.tensor([-120.0, -30.0, 0.0, 90.0])[: min(n, 4)]
    gate, up = x.split(n, dim=-1)
    reference = F.silu(gate) * up
    out = silu_mul(x)
    assert out.shape == (rows, n)
    assert ((out - reference).abs() <= 1e-5 * reference.abs() + 1e-30).all()


@built
@pytest.mark.parametrize("rows, n", [(1, 1536), (7, 40), (3, 1), (2, 13)])
def test_bfloat16_is_the_float32_result_rounded_once(rows, n, instruction_set):
    """bf16 rows widened exactly, the float32 formula, one rounding: torch's float32 SiLU x up
    of the same (widened) values, rounded to bf16, within one bf16 step."""
    x = (torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(rows)) * 6).bfloat16()
    gate, up = x.float().split(n, dim=-1)
    reference = F.silu(gate) * up
    out = silu_mul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert ((out.float() - reference).abs() <= 2 ** -8 * reference.abs() + 1e-30).all()


def test_declines_what_it_does_not_compute():
    assert silu_mul(torch.randn(4, 64).half()) is None
    assert silu_mul(torch.randn(64, 4).T) is None  # not contiguous
    assert silu_mul(torch.randn(4, 63)) is None  # no halves
    assert silu_mul(torch.randn(2, 4, 64)) is None  # not rows
