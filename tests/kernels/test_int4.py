"""INT4 (W4A16) weights: packing, RTN error bound, reference and Triton kernel
(compiled on CUDA, through the Triton interpreter on CPU). The AWQ / GPTQ loaders
are checked in test_int4_checkpoints.py.

Format: W = q * scale + offset per group (float offset, the scales' dtype).

Stated bounds (checked below):
  * RTN over each group's own [min, max]: every element |w - dequant(w)| <= scale/2
    of its group (stored scale, ~(max - min)/15); on Gaussian weights the relative
    Frobenius error is 0.0998 (G=128) / 0.0897 (G=64) / 0.0782 (G=32), asserted below
    0.1005 / 0.091 / 0.081 and never above the old integer-zero-point RTN (0.1005 /
    0.0910 / 0.0808); far smaller on groups that do not straddle 0.
  * Exact round trip of weights on a d * q + m grid (GGUF Q4_1: fp16 d, m, G = 32)
    and of the old integer-zero-point grids.
  * reference vs float64 dense product of the dequantized weight: relative Frobenius
    error < 4e-3 (bf16 output), < 5e-4 (fp16), < 1e-6 (fp32).
  * Triton vs float64: < 8e-3 (bf16; the interpreter truncates fp32->bf16 instead of
    rounding, ~2x the reference's error), < 5e-4 (fp16).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from .gemm_checks import (  # first: sets TRITON_INTERPRET=1 without CUDA
    DEVICE, REF_TOL, TRITON_TOL, llama_case, llama_shapes, needs_triton, rel_err,
)
from pagedserve.kernels.dispatch import int4_linear
from pagedserve.kernels.int4 import (
    default_scale_dtype,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
    w4a16_matmul_ref,
)


# ----------------------------------------------------------------- packing / quantization

def test_pack_bit_order_and_roundtrip():
    col = torch.arange(8, dtype=torch.uint8).view(8, 1)  # k = 0..7 of one output column
    assert pack_int4(col).item() == 0x76543210
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (8, 24) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(unpack_int4(packed.t().contiguous().t()), q)  # non-contiguous path


def _rtn_integer_zero(w: torch.Tensor, g: int) -> torch.Tensor:
    """The previous format's RTN (range widened to include 0, integer zero point,
    fp32 scale), dequantized: the baseline the float offset must not lose to."""
    n, k = w.shape
    v = w.float().view(n, k // g, g)
    lo, hi = v.amin(-1, keepdim=True).clamp(max=0), v.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-30)
    z = torch.round(-lo / s).clamp(0, 15)
    return ((torch.round(v / s) + z).clamp(0, 15) - z).mul(s).view(n, k)


GAUSS_TOL = {128: 0.1005, 64: 0.091, 32: 0.081}


@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                               (torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("group_size", [128, 64, 32])
def test_rtn_error_bound(dtype, scale_dtype, group_size):
    gen = torch.Generator().manual_seed(2)
    n, k = 48, 512
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    w[3, :group_size] = (torch.rand(group_size, generator=gen) + 0.5).to(dtype)  # one all-positive group
    w[4, :group_size] = (-torch.rand(group_size, generator=gen) * 0.02 - 0.3).to(dtype)  # narrow, far from 0
    q = quantize_int4(w, group_size, scale_dtype=scale_dtype)
    sd = scale_dtype or default_scale_dtype(dtype)
    assert q.shape == (n, k) and q.scales.dtype == sd and q.offsets.dtype == sd
    assert q.nbytes == k // 2 * n + (k // group_size) * n * 2 * sd.itemsize
    # offset = group minimum, rounded down only where the scale dtype cannot hold it
    gmin = w.float().view(n, k // group_size, group_size).amin(-1).t()
    assert bool((q.offsets.float() <= gmin).all())
    exact = gmin.to(sd).float() == gmin
    assert torch.equal(q.offsets.float()[exact], gmin[exact])
    assert bool(exact.all()) or scale_dtype is not None  # the default dtype holds every minimum
    deq = dequantize_int4(q)
    scale = q.scales.to(torch.float32).t().repeat_interleave(group_size, dim=1)
    err = (deq - w.float()).abs()
    assert bool((err <= scale * 0.5 * (1 + 1e-5)).all()), float((err / scale).max())
    # groups not straddling 0: their own range, not one widened to 0 (~2/3 and ~1/15 of the error)
    old = (_rtn_integer_zero(w[3:5].float(), group_size) - w[3:5].float()).abs()[:, :group_size].amax(-1)
    new = err[3:5, :group_size].amax(-1)
    assert float(new[0]) < 0.7 * float(old[0]) and float(new[1]) < 0.1 * float(old[1]), (new, old)
    w_gauss = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    deq = dequantize_int4(quantize_int4(w_gauss, group_size, scale_dtype=scale_dtype))
    e = rel_err(deq, w_gauss)
    assert e < GAUSS_TOL[group_size], e
    assert e <= rel_err(_rtn_integer_zero(w_gauss, group_size), w_gauss), e


def test_default_scale_dtype():
    w = torch.randn(8, 64)
    for dtype, want in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                        (torch.float16, torch.float16), (torch.float64, torch.float32)]:
        assert default_scale_dtype(dtype) == want
        qw = quantize_int4(w.to(dtype), 32)
        assert qw.scales.dtype == want and qw.offsets.dtype == want
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_int4(w, 32, scale_dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_int4(torch.full((8, 64), float("nan")), 32)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_int4(torch.full((8, 64), -1e6), 32, scale_dtype=torch.float16)  # offset overflows fp16


@pytest.mark.parametrize("scale_dtype", [None, torch.float16])
def test_rtn_exact_on_q4_1_grid(scale_dtype):
    """GGUF Q4_1 blocks (32 values d * q + m, fp16 d and m, ggml dequantizes in fp32;
    its quantizer maps each block's min and max to codes 0 and 15) re-quantize exactly."""
    gen = torch.Generator().manual_seed(3)
    n, k, g = 64, 512, 32
    ng = k // g
    q = torch.randint(0, 16, (n, ng, g), generator=gen)
    pos = torch.rand(n, ng, g, generator=gen).argsort(-1)[..., :2]  # two distinct random slots
    q.scatter_(-1, pos[..., :1], 0)
    q.scatter_(-1, pos[..., 1:], 15)
    d = torch.exp(torch.empty(n, ng, 1).uniform_(-9.0, -3.5, generator=gen)).half().float()  # ~1e-4 .. 3e-2
    m = (-d * torch.empty(n, ng, 1).uniform_(-2.0, 15.0, generator=gen)).half().float()
    m[0, 0] = 0.0
    w = (q.float() * d + m).view(n, k)
    assert torch.equal(w.double(), (q.double() * d.double() + m.double()).view(n, k))  # grid exact in fp32
    qw = quantize_int4(w, g, scale_dtype=scale_dtype)
    assert torch.equal(qw.scales.float(), d.squeeze(-1).t())
    assert torch.equal(qw.offsets.float(), m.squeeze(-1).t())
    assert torch.equal(unpack_int4(qw.qweight).t().long(), q.view(n, k))
    assert torch.equal(dequantize_int4(qw), w)
    x = torch.randn(3, k, generator=gen)
    assert rel_err(w4a16_matmul_ref(x, qw), x.double() @ w.double().t()) < REF_TOL[torch.float32]


def test_rtn_exact_on_integer_zero_grid():
    """Weights on the old format's grid (q - z) * s, s a power of two, come back exactly."""
    gen = torch.Generator().manual_seed(3)
    n, k, g = 16, 256, 128
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[:, ::g] = 0
    q[:, 1::g] = 15
    z = torch.randint(1, 15, (n, k // g), generator=gen)
    s = 2.0 ** -torch.randint(4, 9, (n, k // g), generator=gen).float()
    w = (q - z.repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)
    for sd in (None, torch.float16, torch.bfloat16):
        qw = quantize_int4(w, g, scale_dtype=sd)
        assert torch.equal(dequantize_int4(qw), w)
        assert torch.equal(unpack_int4(qw.qweight).t().long(), q)


@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, torch.float16)])
def test_rtn_constant_groups(dtype, scale_dtype):
    """max == min: tiny positive scale, offset = the value (rounded down if the scale
    dtype cannot hold it), so the group comes back exactly where it can."""
    vals = torch.tensor([0.0, -0.0, 1.0, -3.25, 0.1, -1e-3])
    w = vals.repeat_interleave(32).view(1, -1).to(dtype)
    qw = quantize_int4(w, 32, scale_dtype=scale_dtype)
    sd = qw.scales.dtype
    assert bool((qw.scales > 0).all()) and bool((qw.scales.float() <= torch.finfo(sd).tiny * 16).all())
    deq = dequantize_int4(qw)
    representable = (vals.to(dtype).to(sd).float() == vals.to(dtype).float()).repeat_interleave(32)
    assert torch.equal(deq[0][representable], w.float()[0][representable])
    scale = qw.scales.float().t().repeat_interleave(32, 1)
    assert bool(((deq - w.float()).abs() <= scale * 0.5 * (1 + 1e-5)).all())


@pytest.mark.parametrize("m", [3, 40])  # group-factored path, dequantize-once path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matmul(m, dtype):
    gen = torch.Generator().manual_seed(4)
    n, k = 72, 384
    qw = quantize_int4(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(2, m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = w4a16_matmul_ref(x, qw, bias)
    assert y.shape == (2, m, n) and y.dtype == dtype
    truth = x.double() @ dequantize_int4(qw).double().t() + bias.double()
    assert rel_err(y, truth) < REF_TOL[dtype]


# ----------------------------------------------------------------- Triton kernel

def _triton():
    from pagedserve.kernels.triton import int4 as int4_triton

    return int4_triton


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,split,bias", [(1, 1, True), (1, 3, False), (5, 2, True), (37, 1, True)])
def test_triton_matches_reference(dtype, m, split, bias):
    it = _triton()
    gen = torch.Generator().manual_seed(10 + m + split)
    n, k = 80, 384  # N not a multiple of the tile, 3 groups
    w = torch.randn(n, k, generator=gen) * 0.05
    w[::7] += 0.3  # groups far from 0: large offsets against a small scale
    qw = quantize_int4(w).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    cfg = it.GemmConfig(16, 64, 128, split_k=split)
    y = it.w4a16_matmul_triton(x, qw, b, config=cfg)
    truth = x.double() @ dequantize_int4(qw).double().t() + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, truth) < TRITON_TOL[dtype]
    assert rel_err(y, w4a16_matmul_ref(x.cpu(), qw.to("cpu"), None if b is None else b.cpu())) < TRITON_TOL[dtype]


@needs_triton
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,split", [(4, 2), (33, 1)])
def test_triton_scale_dtypes(scale_dtype, m, split):
    """Scales and offsets in each storage dtype (bf16 is the serving default for bf16
    models), on a Q4_1-like grid with group 32 and offsets of both signs."""
    it = _triton()
    gen = torch.Generator().manual_seed(50 + m)
    n, k = 40, 256
    w = torch.randn(n, k, generator=gen) * 0.02 + torch.randn(n, 1, generator=gen) * 0.1
    qw = quantize_int4(w.to(scale_dtype) if scale_dtype != torch.float16 else w, 32, scale_dtype=scale_dtype)
    assert qw.offsets.dtype == scale_dtype
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    y = it.w4a16_matmul_triton(x.to(DEVICE), qw.to(DEVICE), b.to(DEVICE), config=it.GemmConfig(16, 64, 32, split_k=split))
    truth = x.double() @ dequantize_int4(qw).double().t() + b.double()
    assert rel_err(y, truth) < TRITON_TOL[torch.bfloat16]


def test_int4_linear_dispatch(monkeypatch):
    gen = torch.Generator().manual_seed(30)
    qw = quantize_int4(torch.randn(32, 256, generator=gen) * 0.05)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    b = torch.randn(32, generator=gen).to(torch.bfloat16)
    monkeypatch.delenv("PAGEDSERVE_FORCE_TRITON", raising=False)
    assert torch.equal(int4_linear(x, qw, b), w4a16_matmul_ref(x, qw, b))  # CPU -> reference
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        monkeypatch.setenv("PAGEDSERVE_FORCE_TRITON", "1")
        y = int4_linear(x, qw, b)
        assert rel_err(y, w4a16_matmul_ref(x, qw, b)) < TRITON_TOL[torch.bfloat16]


# ----------------------------------------------------------------- GPU, real shapes

@llama_shapes
def test_gpu_llama_shapes(shape, m):
    it = _triton()
    w, x, b = llama_case(shape, m)
    qw = quantize_int4(w.to(torch.bfloat16))  # bf16 scales
    y = it.w4a16_matmul_triton(x, qw, b)
    truth = x.double() @ dequantize_int4(qw).double().t() + b.double()
    assert rel_err(y, truth) < REF_TOL[torch.bfloat16] * 1.5


@needs_triton
@pytest.mark.parametrize("group", [32, 128])
def test_dequantize_then_matmul_candidate_for_prompt_sized_m(group):
    """Prompt-sized M also times dequantizing the weight in one Triton pass, then one
    matmul: the dense weight is the reference's, rounded once to the activation dtype."""
    it = _triton()
    gen = torch.Generator().manual_seed(group)
    w = quantize_int4(torch.randn(96, 256, generator=gen) * 0.05, group)
    dense = it.dequantize_int4_triton(w.to(DEVICE), torch.bfloat16).float().cpu()
    exact = dequantize_int4(w, torch.float64).t()
    # rounded once to bf16 (the interpreter truncates: within one ulp, 2^-7 relative)
    assert dense.shape == exact.shape and ((dense - exact).abs() <= exact.abs() * 2**-7 + 1e-6).all()
    x = torch.randn(80, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert it.DEQUANT_MATMUL in it._candidates(80, 4096, 4096, 128) or it.interpreting()
    y = it.w4a16_matmul_triton(x, w.to(DEVICE), config=it.DEQUANT_MATMUL)
    truth = x.double().cpu() @ dequantize_int4(w, torch.float64).t()
    assert rel_err(y.cpu(), truth) < 1e-2
