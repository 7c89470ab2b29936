"""The C RMSNorm (kernels/cpu/rms_norm.py) against the model's torch RMSNorm.

Same rounding order as transformers (fp32 math, normalised row rounded to the model
dtype, times the weight); only the summation order of the mean of squares differs.
Bounds: bfloat16 at most one element in 10,000 differs, by at most two bf16 steps (a
flip of the normalised row's rounding, carried through the weight; measured ~1 in 100,000); float32 within 4e-7 relative (measured ~1e-7)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.models.llama import RMSNorm
from pagedserve.kernels.cpu import rms_norm as rms_norm_cpu

built = pytest.mark.skipif(rms_norm_cpu.LIBRARY.get() is None, reason="the C RMSNorm is not built here (no C compiler)")


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm with the C path switched off (its torch ops)."""
    norm = RMSNorm(x.shape[-1], eps).to(x.dtype)
    norm.weight.data = weight
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@built
@pytest.mark.parametrize("rows", [1, 7, 32, 300, 2048])
@pytest.mark.parametrize("hidden", [576, 4096, 100])
def test_bfloat16_matches_torch(rows, hidden):
    g = torch.Generator().manual_seed(rows * 10_000 + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).bfloat16()
    weight = torch.randn(hidden, generator=g).bfloat16()
    out, ref = rms_norm_cpu.rms_norm(x, weight, 1e-5), torch_norm(x, weight, 1e-5)
    differ = out != ref
    assert differ.float().mean() <= 1e-4
    if differ.any():  # a rounding step of the normalised row, carried through the weight: <= 2 bf16 steps
        assert ((out.float() - ref.float()).abs()[differ] <= ref.float().abs()[differ] * 2**-6).all()


@built
@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_float32_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=g) * 5, torch.randn(576, generator=g)
    torch.testing.assert_close(rms_norm_cpu.rms_norm(x, weight, 1e-6), torch_norm(x, weight, 1e-6), rtol=4e-7, atol=1e-7)


@built
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_residual_add_then_norm_matches_torch(dtype, rows):
    """The sum is exactly torch's (h + delta in the dtype); its norm within the bounds above."""
    g = torch.Generator().manual_seed(rows + 7)
    h, delta = (torch.randn(rows, 576, generator=g) * 3).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    total, out = rms_norm_cpu.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(total, h + delta)
    ref = torch_norm(h + delta, weight, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-7, atol=1e-7)
    else:
        assert (out != ref).float().mean() <= 1e-4
    torch.testing.assert_close(RMSNorm(576, 1e-5).to(dtype).add_and_norm(h, delta)[0], h + delta, rtol=0, atol=0)


def test_what_it_does_not_take_is_left_to_torch():
    x = torch.randn(4, 64)
    assert rms_norm_cpu.rms_norm(x.half(), torch.ones(64).half(), 1e-5) is None  # float16
    assert rms_norm_cpu.rms_norm(x.t(), torch.ones(4), 1e-5) is None  # not contiguous
    assert rms_norm_cpu.rms_norm(x[None], torch.ones(64), 1e-5) is None  # 3-D
    assert rms_norm_cpu.rms_norm(x, torch.ones(64).bfloat16(), 1e-5) is None  # weight of another dtype
    assert rms_norm_cpu.add_rms_norm(x, x.bfloat16(), torch.ones(64), 1e-5) is None  # residual of another dtype
    assert rms_norm_cpu.add_rms_norm(x, x[:2], torch.ones(64), 1e-5) is None  # of another shape
    norm = RMSNorm(64, 1e-5)
    torch.testing.assert_close(norm(x[None])[0], norm(x))  # the model's norm answers either way
    h, normed = norm.add_and_norm(x[None].half(), x[None].half())
    torch.testing.assert_close(h[0], 2 * x.half())
