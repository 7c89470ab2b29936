"""FP8 (e4m3) weights: quantization bounds, references, Triton kernels (both the FP8
tensor-core path and the W8A16 path run under the Triton interpreter on CPU).

Stated bounds (checked below):
  * e4m3 RTN (3 mantissa bits): |w - dequant(w)| <= 2^-4 |w| in the normal range and
    <= 2^-10 * scale (half the subnormal step) below it; relative Frobenius error on
    Gaussian data ~0.02 (asserted < 0.03).
  * reference vs float64 dense product of the dequantized weight: < 4e-3 (bf16 out),
    < 5e-4 (fp16), < 1e-6 (fp32).
  * Triton "w8a16" vs float64 of the same product, and "fp8" vs float64 of the product
    of per-token-quantized activations (`fp8_w8a8_matmul_ref`): < 8e-3 (bf16),
    < 5e-4 (fp16). "fp8" vs the W8A16 reference (activation quantization error
    included): < 0.04.
  * Triton per-token activation quantizer == `quantize_per_token_fp8`, bit for bit.
  * Block-wise weights (one scale per rows x columns tile, as DeepSeek-style checkpoints
    store them) read back exactly as the grouped form; the grouped products obey the
    bounds above.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from .gemm_checks import (  # first: sets TRITON_INTERPRET=1 without CUDA
    DEVICE, HAS_CUDA, REF_TOL, TRITON_TOL, llama_case, llama_shapes, needs_triton, rel_err,
)
from pagedserve.kernels.dispatch import fp8_linear
from pagedserve.kernels.fp8 import (
    Fp8Weight,
    Int8Weight,
    dequantize_fp8,
    fp8_matmul_ref,
    fp8_from_blocks,
    fp8_w8a8_matmul_ref,
    quantize_fp8,
    quantize_fp8_blocks,
    quantize_per_token_fp8,
)
from pagedserve.kernels.numerics import FP8_DTYPE

needs_fp8_tc = pytest.mark.skipif(
    HAS_CUDA and torch.cuda.get_device_capability() < (8, 9), reason="FP8 tensor cores need sm89+"
)

ACT_QUANT_TOL = 0.04


def _triton():
    from pagedserve.kernels.triton import fp8 as fp8_triton

    return fp8_triton


# ----------------------------------------------------------------- quantization

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_error_bound(dtype):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 300, generator=gen) * torch.logspace(-3, 0, 64).unsqueeze(1)).to(dtype)
    q = quantize_fp8(w)
    assert q.weight.dtype == FP8_DTYPE and q.scale.dtype == torch.float32 and q.shape == (64, 300)
    wf = w.float()
    assert torch.allclose(q.scale, wf.abs().amax(1) / 448)
    assert torch.equal(q.weight.float().abs().amax(1), torch.full((64,), 448.0))
    err = (dequantize_fp8(q) - wf).abs()
    bound = torch.maximum(wf.abs() * 2.0**-4, q.scale.unsqueeze(1) * 2.0**-10) * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert rel_err(dequantize_fp8(q), wf) < 0.03


def test_quantize_fp8_exact_on_grid():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 126, (16, 64), generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, (16, 64), generator=gen, dtype=torch.uint8) << 7  # signs
    codes[:, 0] = 0x7E  # 448 in every row, so the scale is exactly 2^e / 448 * 448
    scale = 2.0 ** torch.randint(-10, 0, (16,), generator=gen).float()
    w = codes.view(FP8_DTYPE).float() * scale.unsqueeze(1)
    q = quantize_fp8(w)
    assert torch.equal(dequantize_fp8(q), w)


def test_per_token_quant():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=gen) * torch.tensor([1e-4, 1e-2, 1, 10, 300, 1]).unsqueeze(1)
    x[5] = 0.0
    xq, xs = quantize_per_token_fp8(x.to(torch.bfloat16))
    assert xq.dtype == FP8_DTYPE and xs.shape == (6,) and bool((xs > 0).all())
    assert torch.equal(xq[5].float(), torch.zeros(200))
    back = xq.float() * xs.unsqueeze(1)
    xb = x.to(torch.bfloat16).float()
    bound = torch.maximum(xb.abs() * 2.0**-4, xs.unsqueeze(1) * 2.0**-10) * (1 + 1e-6)
    assert bool(((back - xb).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matmul(dtype):
    gen = torch.Generator().manual_seed(4)
    w = quantize_fp8(torch.randn(72, 256, generator=gen) * 0.05)
    x = torch.randn(2, 5, 256, generator=gen).to(dtype)
    b = torch.randn(72, generator=gen).to(dtype)
    y = fp8_matmul_ref(x, w, b)
    assert y.shape == (2, 5, 72) and y.dtype == dtype
    assert rel_err(y, x.double() @ dequantize_fp8(w).double().t() + b.double()) < REF_TOL[dtype]
    y8 = fp8_w8a8_matmul_ref(x, w, b)
    assert 0 < rel_err(y8, y) < ACT_QUANT_TOL


def test_fp8_weight_validation():
    with pytest.raises(ValueError):
        Fp8Weight(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError):
        Fp8Weight(torch.zeros(4, 8).to(FP8_DTYPE), torch.ones(5))
    with pytest.raises(ValueError, match=r"scale must be fp32 \[4, 3\]"):
        Fp8Weight(torch.zeros(4, 40).to(FP8_DTYPE), torch.ones(4), group_size=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        Fp8Weight(torch.zeros(4, 40).to(FP8_DTYPE), torch.ones(4, 2), group_size=20)
    with pytest.raises(ValueError, match="torch.int8 tensor"):
        Int8Weight(torch.zeros(4, 8).to(FP8_DTYPE), torch.ones(4))


def test_block_wise_weights_read_back_as_their_blocks_say():
    """Codes and one scale per 16 x 32 tile (partial tiles at both edges): the grouped weight
    dequantizes to codes * its block's scale, exactly, and the quantizer's error is e4m3's."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(40, 100, generator=gen) * torch.logspace(-3, 0, 40).unsqueeze(1)
    codes, block_scale = quantize_fp8_blocks(w, (16, 32))
    assert codes.dtype == FP8_DTYPE and codes.shape == (40, 100) and block_scale.shape == (3, 4)
    grouped = fp8_from_blocks(codes, block_scale, (16, 32))
    assert grouped.group_size == 32 and grouped.scale.shape == (40, 4)
    expected = codes.float() * block_scale.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :100]
    assert torch.equal(dequantize_fp8(grouped), expected)
    assert rel_err(dequantize_fp8(grouped), w) < 0.03
    with pytest.raises(ValueError, match=r"\[3, 4\] scales"):
        fp8_from_blocks(codes, block_scale[:2], (16, 32))
    x = torch.randn(5, 100, generator=gen)
    assert rel_err(fp8_matmul_ref(x, grouped), x.double() @ expected.double().t()) < REF_TOL[torch.float32]
    assert 0 < rel_err(fp8_w8a8_matmul_ref(x, grouped), fp8_matmul_ref(x, grouped)) < ACT_QUANT_TOL


# ----------------------------------------------------------------- Triton kernels

@needs_triton
def test_triton_per_token_quant_bit_exact():
    ft = _triton()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 700, generator=gen) * torch.logspace(-6, 3, 8).unsqueeze(1)
    x[1, :7] = 0.0
    x[2] = 0.0
    # Every e4m3 value, every midpoint between neighbours (ties) and its two fp32 neighbours.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    ties = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    ties = torch.cat([ties, -ties]).unsqueeze(0)  # the row amax is 448, so the scale is 1
    for t in (x, ties, x.to(torch.bfloat16)):
        t = t.to(DEVICE)
        q, s = ft.per_token_quant_fp8_triton(t)
        rq, rs = quantize_per_token_fp8(t)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


CASES = [(1, 1, True), (3, 2, False), (40, 1, True)]
GROUPS = [0, 64, 128]
"""Per-channel scales, and block-wise ones whose groups hold one or two 64-wide K tiles."""


def _triton_case(seed, dtype, m, split, bias, mode, group=0):
    """Seeded w [80, 200] (N and K both leave partial tiles), x [m, 200], optional bias,
    and their Triton product in `mode` with 16x64x64 tiles and `split` K-slices; with
    `group`, w in 32 x `group` blocks."""
    ft = _triton()
    gen = torch.Generator().manual_seed(seed)
    n, k = 80, 200
    dense = torch.randn(n, k, generator=gen) * 0.05
    w = (fp8_from_blocks(*quantize_fp8_blocks(dense, (32, group)), (32, group)) if group else quantize_fp8(dense)).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    y = ft.fp8_matmul_triton(x, w, b, mode=mode, config=ft.GemmConfig(16, 64, 64, split_k=split))
    return w, x, b, y


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,split,bias", CASES)
@pytest.mark.parametrize("group", GROUPS)
def test_triton_w8a16(dtype, m, split, bias, group):
    w, x, b, y = _triton_case(10 + m, dtype, m, split, bias, "w8a16", group)
    assert y.dtype == dtype and y.shape == (m, 80)
    truth = x.double() @ dequantize_fp8(w).double().t() + (b.double() if bias else 0)
    assert rel_err(y, truth) < TRITON_TOL[dtype]


@needs_triton
@needs_fp8_tc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,split,bias", CASES)
@pytest.mark.parametrize("group", GROUPS)
def test_triton_fp8_tensor_core_path(dtype, m, split, bias, group):
    w, x, b, y = _triton_case(20 + m, dtype, m, split, bias, "fp8", group)
    xq, xs = quantize_per_token_fp8(x)
    truth = (xq.double() * xs.double().unsqueeze(1)) @ dequantize_fp8(w).double().t()
    truth = truth + (b.double() if bias else 0)
    assert rel_err(y, truth) < TRITON_TOL[dtype]
    assert rel_err(y, fp8_w8a8_matmul_ref(x, w, b)) < TRITON_TOL[dtype]
    assert rel_err(y, fp8_matmul_ref(x, w, b)) < ACT_QUANT_TOL


@needs_triton
@pytest.mark.parametrize("m,split,bias", CASES)
@pytest.mark.parametrize("group", [0, 64])
def test_triton_int8_weights(m, split, bias, group):
    """int8 codes (W8A16 checkpoints) with channel or group scales: the "w8a16" path, exact codes;
    mode "fp8" is refused for them."""
    ft = _triton()
    gen = torch.Generator().manual_seed(50 + m)
    codes = torch.randint(-127, 128, (80, 200), generator=gen, dtype=torch.int8)
    scale = torch.rand((80, 4) if group else (80,), generator=gen) * 1e-3
    w = Int8Weight(codes, scale, group).to(DEVICE)
    x = torch.randn(m, 200, generator=gen).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(80, generator=gen).to(torch.bfloat16).to(DEVICE) if bias else None
    y = ft.fp8_matmul_triton(x, w, b, config=ft.GemmConfig(16, 64, 64, split_k=split))
    truth = x.double() @ dequantize_fp8(w).double().t() + (b.double() if bias else 0)
    assert rel_err(y, truth) < TRITON_TOL[torch.bfloat16]
    assert rel_err(fp8_matmul_ref(x, w, b), truth) < REF_TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="int8 weights run in mode 'w8a16'"):
        ft.fp8_matmul_triton(x, w, mode="fp8")


@needs_triton
def test_triton_w8a16_decodes_every_code():
    """One-hot activations read back every non-NaN e4m3 code exactly (fp16 output)."""
    ft = _triton()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(2, 127)  # N=2, K=127: all 254 codes
    w = Fp8Weight(codes.view(FP8_DTYPE).to(DEVICE), torch.ones(2, device=DEVICE))
    x = torch.eye(127, dtype=torch.float16, device=DEVICE)
    y = ft.fp8_matmul_triton(x, w, mode="w8a16")
    assert torch.equal(y.t().float().cpu(), codes.view(FP8_DTYPE).float())


def test_fp8_linear_dispatch(monkeypatch):
    gen = torch.Generator().manual_seed(30)
    w = quantize_fp8(torch.randn(32, 96, generator=gen) * 0.05)
    x = torch.randn(2, 3, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(32, generator=gen).to(torch.bfloat16)
    monkeypatch.delenv("PAGEDSERVE_FORCE_TRITON", raising=False)
    assert torch.equal(fp8_linear(x, w, b), fp8_matmul_ref(x, w, b))
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        monkeypatch.setenv("PAGEDSERVE_FORCE_TRITON", "1")
        monkeypatch.setenv("PAGEDSERVE_FP8_MODE", "w8a16")
        y = fp8_linear(x, w, b)
        assert y.shape == (2, 3, 32)
        assert rel_err(y, fp8_matmul_ref(x, w, b)) < TRITON_TOL[torch.bfloat16]


# ----------------------------------------------------------------- GPU, real shapes

@needs_triton
def test_group_scales_cap_the_k_tile():
    """With 128-column groups no candidate tile straddles two (BLOCK_K divides 128), no candidate
    is cuBLAS's channel-scaled GEMM, and a given tile that would straddle is refused by name."""
    ft = _triton()
    for m in (1, 32, 512):
        for mode in ("fp8", "w8a16"):
            assert all(128 % c.block_k == 0 for c in ft._candidates(m, 4096, 4096, mode, 128))
    w = fp8_from_blocks(*quantize_fp8_blocks(torch.randn(32, 64), (32, 32)), (32, 32)).to(DEVICE)
    x = torch.randn(1, 64).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="BLOCK_K dividing 32"):
        ft.fp8_matmul_triton(x, w, mode="w8a16", config=ft.GemmConfig(16, 64, 64))


@llama_shapes
@pytest.mark.parametrize("group", [0, 128])
def test_gpu_llama_shapes(shape, m, group):
    ft = _triton()
    w, x, b = llama_case(shape, m)
    w = fp8_from_blocks(*quantize_fp8_blocks(w.cpu(), (128, 128)), (128, 128)).to(w.device) if group else quantize_fp8(w)
    y = ft.fp8_matmul_triton(x, w, b)  # mode chosen by device capability
    mode = ft.default_mode(x.device)
    ref = fp8_w8a8_matmul_ref(x, w, b) if mode == "fp8" else fp8_matmul_ref(x, w, b)
    assert rel_err(y, ref) < REF_TOL[torch.bfloat16] * 2
    y16 = ft.fp8_matmul_triton(x, w, b, mode="w8a16")
    assert rel_err(y16, fp8_matmul_ref(x, w, b)) < REF_TOL[torch.bfloat16] * 2


@needs_triton
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_mode_decode_candidates_without_activation_quantization(m):
    """On e4m3 hardware "fp8" mode also times, for decode-sized M, launches that multiply the
    fp8 weight by the activations as they are (no per-token quantization kernel; the GEMV too): such a
    launch computes the W8A16 product, exactly the reference's."""
    ft = _triton()
    gen = torch.Generator().manual_seed(30 + m)
    w = quantize_fp8(torch.randn(80, 200, generator=gen) * 0.05).to(DEVICE)
    x = torch.randn(m, 200, generator=gen).to(torch.bfloat16).to(DEVICE)
    variants = {c.variant for c in ft._candidates(m, 4096, 4096, "fp8")}
    assert variants == {"", "w8a16", "gemv"} or ft.interpreting()  # the GEMV (triton/gemv.py) first at M <= 4
    config = ft.GemmConfig(16, 64, 64, split_k=1, variant="w8a16")
    assert not ft.quantizes(config, "fp8") and ft.quantizes(ft.GemmConfig(16, 64, 64), "fp8")
    y = ft.fp8_matmul_triton(x, w, mode="fp8", config=config)
    assert rel_err(y, fp8_matmul_ref(x, w)) < TRITON_TOL[torch.bfloat16]
