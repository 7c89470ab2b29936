"""AWQ / GPTQ 4-bit checkpoint loaders (kernels/int4_checkpoints.py), against packers
written here from the formats' documented bit orders.

Stated bound: bit-exact codes and scales; offsets = -zero * scale rounded once to the
scale dtype, so |dequant - (q - zero) * scale| <= u * zero * scale (+ fp32 rounding),
u = 2^-11 fp16 (<= scale/128), 2^-8 bf16, 0 for fp32 scales.
"""

from __future__ import annotations

import pytest
import torch

from .gemm_checks import DEVICE, REF_TOL, TRITON_TOL, needs_triton, rel_err  # first: sets TRITON_INTERPRET=1 without CUDA
from pagedserve.kernels.int4 import Int4Weight, dequantize_int4, unpack_int4, w4a16_matmul_ref
from pagedserve.kernels.int4_checkpoints import int4_from_awq, int4_from_gptq, offsets_from_zeros


# ----------------------------------------------------------------- own checkpoint packers
# Written from the formats' documented bit orders, independently of the loaders:
#  AutoAWQ GEMM (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear): qweight [K, N/8],
#    qzeros [K/G, N/8], packed along N; nibble i of packed column c holds column
#    8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; zeros stored as is; W = (q - z) * s.
#  AutoGPTQ (nn_modules/qlinear/qlinear_cuda_old.py, QuantLinear.pack): qweight [K/8, N],
#    nibble j of row r holds input 8r + j; qzeros [K/G, N/8] sequential along N holding
#    zero - 1 (v1); scales [K/G, N]; g_idx [K].
AWQ_DOC_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _bits_to_int32(v: torch.Tensor) -> torch.Tensor:
    v = v & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def awq_pack(vals: torch.Tensor) -> torch.Tensor:
    r, c = vals.shape
    v = vals.to(torch.int64).view(r, c // 8, 8)
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_DOC_ORDER):
        out |= v[:, :, col] << (4 * i)
    return _bits_to_int32(out)


def gptq_pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [K/8, N], sequential along K."""
    k, n = q.shape
    v = q.to(torch.int64).view(k // 8, 8, n)
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        out |= v[:, j] << (4 * j)
    return _bits_to_int32(out)


def gptq_pack_zeros(z: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """[G, N] -> [G, N/8], sequential along N, v1 stores zero - 1 (masked to 4 bits)."""
    v = (z.to(torch.int64) - (1 if v1 else 0)) & 0xF
    g, n = v.shape
    v = v.view(g, n // 8, 8)
    out = torch.zeros(g, n // 8, dtype=torch.int64)
    for j in range(8):
        out |= v[:, :, j] << (4 * j)
    return _bits_to_int32(out)


def _dense_from_codes(q_nk, z_gn, s_gn, g_idx):
    """The checkpoint's own weight W[n, k] = (q[n, k] - z[g_idx[k], n]) * s[g_idx[k], n],
    in float64 (exact)."""
    z = z_gn.to(torch.float64)[g_idx].t()
    s = s_gn.to(torch.float64)[g_idx].t()
    return (q_nk.to(torch.float64) - z) * s


# Unit roundoff of the cast of -zero * scale to the scale dtype (see offsets_from_zeros).
OFFSET_U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _check_loaded(qw, q_nk, z_gn, s_gn, g_idx) -> float:
    """Loaded weight vs checkpoint: offsets are -z * s rounded once to the scale dtype;
    dequantization is exactly fp32 q * s + offset; the distance to the checkpoint's
    (q - z) * s is within that one rounding (+ fp32 rounding). Returns max error / scale."""
    want_off = (-(z_gn.to(torch.float64) * s_gn.to(torch.float64))).to(s_gn.dtype)
    assert qw.offsets.dtype == s_gn.dtype and torch.equal(qw.offsets, want_off)
    assert torch.equal(qw.scales, s_gn)
    deq = dequantize_int4(qw)
    s32 = s_gn.to(torch.float32)[g_idx].t()
    assert torch.equal(deq, q_nk.to(torch.float32) * s32 + want_off.to(torch.float32)[g_idx].t())
    truth = _dense_from_codes(q_nk, z_gn, s_gn, g_idx)
    zs = (z_gn.to(torch.float64) * s_gn.to(torch.float64))[g_idx].t()
    err = (deq.double() - truth).abs()
    bound = OFFSET_U[s_gn.dtype] * zs + 2.0**-23 * (q_nk.double() * s32.double() + zs)
    assert bool((err <= bound).all()), float((err - bound).max())
    return float((err / s32.double()).max())


def _random_codes(n, k, group, gen, zlo=0, zhi=16):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)
    z = torch.randint(zlo, zhi, (k // group, n), generator=gen, dtype=torch.int64)
    s = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    return q, z, s


# ----------------------------------------------------------------- checkpoint loaders

def test_awq_known_packing():
    vals = torch.arange(8).view(1, 8)
    assert awq_pack(vals).item() == 0x75316420  # nibbles from low: cols 0,2,4,6,1,3,5,7
    qw = int4_from_awq(awq_pack(torch.arange(8).repeat(8, 1)), awq_pack(torch.zeros(1, 8, dtype=torch.long)),
                       torch.ones(1, 8, dtype=torch.float16), group_size=8)
    assert torch.equal(unpack_int4(qw.qweight)[0], torch.arange(8, dtype=torch.uint8))


@pytest.mark.parametrize("group_size,scale_dtype", [(128, torch.float16), (64, torch.float16),
                                                   (128, torch.bfloat16), (64, torch.float32)])
def test_awq_roundtrip_exact(group_size, scale_dtype):
    gen = torch.Generator().manual_seed(5)
    n, k = 96, 256
    q, z, s = _random_codes(n, k, group_size, gen)
    s = s.to(scale_dtype)
    qw = int4_from_awq(awq_pack(q.t()), awq_pack(z), s, group_size)
    assert qw.shape == (n, k) and qw.perm is None
    assert torch.equal(unpack_int4(qw.qweight).t().long(), q)
    rel = _check_loaded(qw, q, z, s, torch.arange(k) // group_size)
    assert rel <= 16 * OFFSET_U[scale_dtype] * (1 + 1e-3)  # <= scale / 128 for fp16 scales
    if scale_dtype == torch.float32:
        assert torch.equal(dequantize_int4(qw).double(), _dense_from_codes(q, z, s, torch.arange(k) // group_size))


@pytest.mark.parametrize("kind", ["asym_v1", "sym_v1", "asym_v2"])
def test_gptq_roundtrip_exact(kind):
    gen = torch.Generator().manual_seed(6)
    n, k, g = 64, 384, 128
    q, z, s = _random_codes(n, k, g, gen, zlo=1)  # v1 cannot store a zero of 0 faithfully
    v1 = kind.endswith("v1")
    if kind.startswith("sym"):
        z = torch.full_like(z, 8)
        assert bool((gptq_pack_zeros(z) == 0x77777777).all())  # what symmetric v1 checkpoints hold
    g_idx = (torch.arange(k) // g).to(torch.int32)
    qw = int4_from_gptq(gptq_pack_rows(q.t()), gptq_pack_zeros(z, v1), s, g_idx, g,
                        checkpoint_format="gptq" if v1 else "gptq_v2")
    assert qw.perm is None
    assert torch.equal(qw.qweight, gptq_pack_rows(q.t()))  # same qweight layout as ours
    _check_loaded(qw, q, z, s, g_idx.long())
    if kind.startswith("sym"):  # -8 * s is exact in fp16: no rounding at all
        assert torch.equal(dequantize_int4(qw).double(), _dense_from_codes(q, z, s, g_idx.long()))


def test_gptq_v1_stored_15_reads_as_16():
    """v1 readers add 1 to the stored nibble, so 0xF means zero point 16; kept as is."""
    n, k, g = 8, 128, 128
    stored = torch.full((1, n // 8), -1, dtype=torch.int32)  # every nibble 0xF
    q = torch.full((k, n), 3, dtype=torch.int64)
    qw = int4_from_gptq(gptq_pack_rows(q), stored, torch.ones(1, n, dtype=torch.float16), None, g)
    assert torch.equal(qw.offsets, torch.full((1, n), -16.0, dtype=torch.float16))
    assert torch.equal(dequantize_int4(qw), torch.full((n, k), -13.0))


def test_offsets_from_zeros_rounding():
    """The one rounding of the loaders, on a case that needs it: 15 * s has 15 significant
    bits, fp16 keeps 11."""
    s = torch.tensor([[1 + 2.0**-10]], dtype=torch.float16)
    off = offsets_from_zeros(torch.tensor([[15]], dtype=torch.uint8), s)
    exact = -15 * (1 + 2.0**-10)
    assert off.dtype == torch.float16 and off.item() != exact
    assert abs(off.item() - exact) <= 2.0**-11 * 15 * s.item()
    assert offsets_from_zeros(torch.tensor([[15]]), s.float()).item() == exact  # fp32 scales: exact
    with pytest.raises(ValueError, match="overflows"):
        offsets_from_zeros(torch.tensor([[16]]), torch.tensor([[60000.0]], dtype=torch.float16))


def _act_order_checkpoint(n, k, g, gen):
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // g  # GPTQ desc_act: groups follow the activation order
    q, z, s = _random_codes(n, k, g, gen, zlo=1)
    packed = (gptq_pack_rows(q.t()), gptq_pack_zeros(z), s, g_idx.to(torch.int32))
    return packed, (q, z, s, g_idx)


def test_gptq_act_order_exact():
    gen = torch.Generator().manual_seed(7)
    (qweight, qzeros, scales, g_idx), codes = _act_order_checkpoint(40, 256, 64, gen)
    qw = int4_from_gptq(qweight, qzeros, scales, g_idx, 64)
    assert qw.perm is not None
    _check_loaded(qw, *codes)
    x = torch.randn(5, 256, generator=gen)
    dense = dequantize_int4(qw)
    assert rel_err(w4a16_matmul_ref(x, qw), x.double() @ dense.double().t()) < REF_TOL[torch.float32]
    x = torch.randn(40, 256, generator=gen)  # dequantize-once path
    assert rel_err(w4a16_matmul_ref(x, qw), x.double() @ dense.double().t()) < REF_TOL[torch.float32]


def test_loaders_reject_bad_input():
    gen = torch.Generator().manual_seed(8)
    q, z, s = _random_codes(16, 256, 128, gen, zlo=1)
    qweight, qzeros = gptq_pack_rows(q.t()), gptq_pack_zeros(z)
    bad = torch.arange(256) % 2  # two groups, but 128 alternating members each is fine...
    bad[:3] = 0  # ...until the sizes differ
    with pytest.raises(ValueError, match="group_size"):
        int4_from_gptq(qweight, qzeros, s, bad, 128)
    with pytest.raises(ValueError):
        int4_from_gptq(qweight, qzeros, s, None, 64)  # scales say 2 groups, not 4
    with pytest.raises(ValueError):
        int4_from_gptq(qweight, qzeros, s, None, 128, checkpoint_format="marlin")
    with pytest.raises(ValueError):
        int4_from_awq(awq_pack(q.t()), awq_pack(z), s, 64)
    with pytest.raises(ValueError):
        Int4Weight(qweight, s, s.clone(), 100, (16, 256))
    with pytest.raises(ValueError, match="offsets"):
        Int4Weight(qweight, s, z.to(torch.uint8), 128, (16, 256))  # integer zero points are gone
    with pytest.raises(ValueError, match="offsets"):
        Int4Weight(qweight, s, s.float(), 128, (16, 256))  # offsets must share the scales' dtype


@needs_triton
@pytest.mark.parametrize("group_size", [64, 32])
def test_triton_small_groups_and_act_order(group_size):
    from pagedserve.kernels.triton import int4 as it

    gen = torch.Generator().manual_seed(20 + group_size)
    (qweight, qzeros, scales, g_idx), _ = _act_order_checkpoint(48, 256, group_size, gen)
    qw = int4_from_gptq(qweight, qzeros, scales, g_idx, group_size)
    dense = dequantize_int4(qw)
    qw = qw.to(DEVICE)
    x = torch.randn(2, 3, 256, generator=gen).to(torch.float16).to(DEVICE)
    y = it.w4a16_matmul_triton(x, qw)  # default (heuristic) config
    assert y.shape == (2, 3, 48)
    assert rel_err(y, x.double() @ dense.double().t().to(x.device)) < TRITON_TOL[torch.float16]
