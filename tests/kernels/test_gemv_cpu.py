"""The C float32 GEMV (kernels/gemv_cpu.py) against torch's matmul.

Only the order of the additions differs from torch's: within 1e-5 relative to the sum of
|x_i w_i| of each output (measured ~1e-7 at SmolLM2's sizes)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import gemv_cpu

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
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = gemv_cpu.gemv(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(gemv_cpu.gemv(x, weight), alone)  # each output's sum does not depend on the split


def q4_exact_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 weight as a GGUF Q4_1 checkpoint dequantizes: per block of 32, d * q + m with
    d, m fp16 values, q in 0..15 and (as the quantizer leaves them) a 0 and a 15 in each block."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    d = (torch.rand(out_features, blocks, generator=g) * 0.01).half().float()
    m = (-torch.rand(out_features, blocks, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (out_features, blocks, 32), generator=g).float()
    q[..., 5], q[..., 27] = 0, 15
    return (d[..., None] * q + m[..., None]).reshape(out_features, in_features)


def q8_exact_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """As a GGUF Q8_0 checkpoint dequantizes: per block of 32, d * q, d an fp16 value, q in
    -127..127 with a +-127 in each block."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    d = (torch.rand(out_features, blocks, generator=g) * 0.001).half().float()
    q = torch.randint(-127, 128, (out_features, blocks, 32), generator=g).float()
    q[..., 9] = -127
    return (d[..., None] * q).reshape(out_features, in_features)


def test_q8_parts_rebuild_the_weight_bit_for_bit():
    weight = q8_exact_weight(64, 96, seed=2)
    parts = gemv_cpu.as_blocks(weight)
    assert parts is not None and parts.kind == "q8_0" and parts.codes.numel() == 64 * 96
    q = parts.codes.view(torch.int8).float().view(64, 3, 32)
    assert torch.equal(parts.scales[..., None] * q, weight.view(64, 3, 32))
    assert gemv_cpu.as_blocks(weight * 1.0001) is None


def test_q4_parts_rebuild_the_weight_bit_for_bit_or_are_refused():
    weight = q4_exact_weight(96, 128, seed=1)
    parts = gemv_cpu.as_blocks(weight)
    assert parts is not None and parts.kind == "q4_1" and parts.shape == (96, 128) and parts.codes.numel() == 96 * 64
    low, high = (parts.codes & 15).float(), (parts.codes >> 4).float()
    q = torch.cat([low.view(96, 4, 16), high.view(96, 4, 16)], dim=-1)
    assert torch.equal(parts.scales[..., None] * q + parts.offsets[..., None], weight.view(96, 4, 32))
    assert gemv_cpu.as_blocks(weight + 1e-6) is None  # off the grid: refused, never approximated
    assert gemv_cpu.as_blocks(torch.randn(96, 128)) is None
    assert gemv_cpu.as_blocks(weight[:, :100].contiguous()) is None  # not whole blocks


@built
@pytest.mark.parametrize("rows", range(1, gemv_cpu.BLOCK_MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_block_weights_multiply_like_their_float32_values(rows, bias, kind):
    weight = (q4_exact_weight if kind == "q4_1" else q8_exact_weight)(200, 576, seed=rows)
    assert gemv_cpu.as_blocks(weight).kind == kind
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    out = gemv_cpu.gemv(x, gemv_cpu.as_blocks(weight), b)
    reference = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    scale = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
    assert ((out.double() - reference).abs() <= 1e-5 * scale).all()
    assert gemv_cpu.gemv(torch.randn(gemv_cpu.BLOCK_MAX_ROWS + 1, 576), gemv_cpu.as_blocks(weight)) is None
