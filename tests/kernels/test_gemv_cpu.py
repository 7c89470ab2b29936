"""The C float32 GEMV (kernels/cpu/gemv.py) against torch's matmul.

Only the order of the additions differs from torch's: within 1e-5 relative to the sum of
|x_i w_i| of each output (measured ~1e-7 at SmolLM2's sizes)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import gemv as gemv_cpu
from .threads import same_on_one_thread

built = pytest.mark.skipif(gemv_cpu.LIBRARY.get() is None, reason="the C GEMV is not built here (no C compiler)")


@built
@pytest.mark.parametrize("rows", range(1, gemv_cpu.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576), (100, 7), (17, 49), (576, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_within_rounding(rows, in_features, out_features, bias):
    g = torch.Generator().manual_seed(rows * 1_000_003 + in_features * 101 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    out = gemv_cpu.gemv(x, weight, b)
    reference = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    scale = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert ((out.double() - reference).abs() <= 1e-5 * scale).all()


@built
def test_declines_what_it_does_not_compute():
    weight = torch.randn(8, 16)
    assert gemv_cpu.gemv(torch.randn(gemv_cpu.GEMV_MAX_ROWS + 1, 16), weight) is None  # too many rows
    assert gemv_cpu.gemv(torch.randn(1, 16).bfloat16(), weight.bfloat16()) is None  # float32 only
    assert gemv_cpu.gemv(torch.randn(16, 2).T, weight) is None  # not contiguous
    assert gemv_cpu.gemv(torch.randn(1, 15), weight) is None  # sizes disagree
    assert gemv_cpu.gemv(torch.randn(1, 16), weight, torch.randn(7)) is None  # bias of another size
    assert gemv_cpu.gemv(torch.randn(0, 16), weight) is None  # no rows


@built
def test_a_large_weight_splits_over_threads_with_the_same_result():
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(1, 576, generator=g), torch.randn(49152 // 8, 576, generator=g)
    assert same_on_one_thread(lambda: gemv_cpu.gemv(x, weight))
