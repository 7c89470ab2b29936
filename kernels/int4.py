"""Group-wise asymmetric INT4 weights for a linear layer (W4A16), torch reference.

Our packed layout (shared by the reference and `triton/int4.py`), for a linear
weight W [N, K] (out_features, in_features) and group size G along K:

  qweight  int32 [K // 8, N]   nibble j (bits 4j..4j+3) of qweight[r, n] holds the
                               unsigned code q[n, 8r + j] in 0..15 (sequential along K,
                               N contiguous: a K-tile of the transposed weight is a
                               plain row block, which is what a GEMM B operand wants)
  scales   fp16/bf16/fp32 [K // G, N]   step of the group's grid
  offsets  float [K // G, N]   value of code 0 (the group's minimum for our own
                               quantizer), same dtype as `scales`
  perm     optional int64 [K]  input-channel permutation (GPTQ act-order): the packed
                               row k' holds input channel perm[k'], so the kernels
                               consume x[:, perm]

  W[n, k] = q[n, k] * scales[k // G, n] + offsets[k // G, n]

A float offset (rather than an integer zero point) represents every common 4-bit
format: AWQ / GPTQ, whose W = (q - z) * s, load as offset = -z * s (their loaders,
and the one rounding this costs, are in kernels/int4_checkpoints.py); GGUF Q4_1
(W = d * q + m, float d and m, groups of 32) is scale = d, offset = m, and
`quantize_int4(.., group_size=32)` of such weights gives that back exactly. Memory per group of G weights: G / 2 bytes
of codes + 2 floats (scale, offset).

This is the GPTQ qweight layout without act-order, so a GPTQ qweight is taken as
is; AWQ (packed along N, interleaved) is unpacked and repacked once at load time.

No triton import here: this module is the CPU path and the test oracle.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

PACK = 8  # int4 values per int32
MAXQ = 15


@dataclass
class Int4Weight:
    """Packed INT4 weight of a linear layer with weight shape (N, K); see module doc."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    shape: Tuple[int, int]
    perm: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        n, k = self.shape
        g = self.group_size
        if k % g or g % PACK:
            raise ValueError(f"group_size {g} must be a multiple of 8 dividing K={k}")
        if tuple(self.qweight.shape) != (k // PACK, n) or self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight must be int32 [{k // PACK}, {n}], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        if tuple(self.scales.shape) != (k // g, n) or not self.scales.is_floating_point():
            raise ValueError(f"scales must be float [{k // g}, {n}], got {tuple(self.scales.shape)}")
        if tuple(self.offsets.shape) != (k // g, n) or self.offsets.dtype != self.scales.dtype:
            raise ValueError(f"offsets must be {self.scales.dtype} [{k // g}, {n}] (the scales' dtype), "
                             f"got {self.offsets.dtype} {tuple(self.offsets.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm must have shape [{k}]")

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a matmul streams from memory (the roofline's weight traffic): codes,
        scales, offsets (and perm): K * N / 2 + 2 * (K // G) * N * scale itemsize."""
        t = [self.qweight, self.scales, self.offsets] + ([self.perm] if self.perm is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    def to(self, device) -> "Int4Weight":
        perm = None if self.perm is None else self.perm.to(device)
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       offsets=self.offsets.to(device), perm=perm)


# ---------------------------------------------------------------- packing helpers

def int4_group_size(in_features: int, source_group_size: int | None = None) -> int:
    """The checkpoint's own 4-bit block size when it has one (re-quantizing a GGUF Q4_1
    with its 32-wide blocks is then exact: scale = d, offset = m); otherwise 128, the
    usual group, where it divides the input width, else the largest of 64, 32, 16."""
    preferred = [source_group_size] if source_group_size and source_group_size <= 128 else []
    for size in preferred + [128, 64, 32, 16]:
        if in_features % size == 0:
            return size
    raise ValueError(f"INT4 needs an input width divisible by 16, got {in_features}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack codes q [K, N] (0..15, K-major = transposed weight) into int32 [K // 8, N],
    sequential along K (nibble j of row r <- q[8r + j])."""
    k, n = q.shape
    if k % PACK:
        raise ValueError("K must be a multiple of 8")
    q = q.to(torch.int64).view(k // PACK, PACK, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device).view(1, PACK, 1)
    packed = (q << shifts).sum(1)  # disjoint bit fields: sum == bitwise or
    return _to_int32_bits(packed)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [K // 8, N] -> uint8 codes [K, N]."""
    r, n = qweight.shape
    if sys.byteorder == "little" and qweight.is_contiguous():
        # Work on bytes: 4x less traffic than int32 shifts (byte b of a little-endian
        # int32 holds nibbles 2b (low half) and 2b + 1 (high half)).
        by = qweight.view(torch.uint8).view(r, n, 4).permute(0, 2, 1)  # [r, 4, n] view
        out = torch.empty(r, 4, 2, n, dtype=torch.uint8, device=qweight.device)
        torch.bitwise_and(by, 15, out=out[:, :, 0])
        torch.bitwise_right_shift(by, 4, out=out[:, :, 1])
        return out.view(r * PACK, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).view(1, PACK, 1)
    return ((qweight.unsqueeze(1) >> shifts) & 15).to(torch.uint8).reshape(r * PACK, n)


def _to_int32_bits(v: torch.Tensor) -> torch.Tensor:
    """int64 holding an unsigned 32-bit pattern -> int32 with the same bits."""
    v = v & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)



# ---------------------------------------------------------------- quantize / dequantize

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def default_scale_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """fp16 / bf16 weights keep their dtype for scales and offsets; anything else
    (float32, float64: the quantizer works in float32) gets float32. Either way a group's
    minimum (of the float32 weight) is stored exactly, which exact round trips need."""
    return weight_dtype if weight_dtype in (torch.float16, torch.bfloat16) else torch.float32


def _round_to(v: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """float32 v -> dtype (float32 or a 16-bit float), rounded toward -inf if `down`,
    else toward +inf."""
    r = v.to(dtype)
    if dtype == v.dtype:
        return r
    miss = r.to(v.dtype) > v if down else r.to(v.dtype) < v
    # One step on the bit pattern (sign-magnitude: +1 moves away from zero), not
    # torch.nextafter, which lacks fp16/bf16 on some devices / torch versions.
    bits = r.view(torch.int16).to(torch.int32)
    away = bits < 0 if down else bits >= 0  # moving away from zero on this side
    step = torch.where(away, bits + 1, bits - 1)
    step = torch.where(r == 0, torch.full_like(bits, -32767 if down else 1), step)  # -/+ smallest subnormal
    return torch.where(miss, step.to(torch.int16).view(dtype), r)


def quantize_int4(weight: torch.Tensor, group_size: int = 128,
                  scale_dtype: Optional[torch.dtype] = None) -> Int4Weight:
    """Round-to-nearest asymmetric INT4 of a [N, K] weight, groups of `group_size` along K.

    Each group's grid spans its own [min, max] (not widened to include 0):
    offset = min, scale = (max - min) / 15, q = round((w - offset) / scale) in 0..15,
    all in float32. `scale_dtype` (scales and offsets) defaults to
    `default_scale_dtype(weight.dtype)`: float32 for float32 weights, the weight dtype
    for fp16 / bf16. Where a value does not fit the scale dtype exactly, the offset is
    rounded down and the scale (computed from that offset) up, so the grid still
    covers the group and every element obeys |w - dequant(w)| <= scale / 2 with the
    stored scale. A group with max == min gets the smallest normal scale of the dtype
    and comes back exactly (its offset is its value).

    Exact round trip: weights on a grid d * q + m (each group using codes 0 and 15,
    d and m representable in the scale dtype, every d * q + m exact in float32) get
    scale = d, offset = m and the same codes, so dequantization is exact. That covers
    GGUF Q4_1 blocks (group_size=32, fp16 d and m, which the default float32 holds;
    ggml's quantizer puts each block's min and max on codes 0 and 15) whenever
    |m| <= about 2^12 d (checked empirically down to |m| = 2^-24 d; beyond 2^12 d,
    15 d + m rounds in float32 and the recovered scale can be off by an ulp).
    """
    n, k = weight.shape
    if group_size == -1:
        group_size = k
    if k % group_size or group_size % PACK:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size} (itself a multiple of 8)")
    if scale_dtype is None:
        scale_dtype = default_scale_dtype(weight.dtype)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    w = weight.detach().to(torch.float32).view(n, k // group_size, group_size)
    off_q = _round_to(w.amin(-1), scale_dtype, down=True)  # <= min, == min when representable
    off = off_q.to(torch.float32).unsqueeze(-1)
    s = ((w.amax(-1, keepdim=True) - off) / MAXQ).clamp(min=torch.finfo(scale_dtype).tiny)
    s_q = _round_to(s.squeeze(-1), scale_dtype, down=False)
    if not (bool(torch.isfinite(s_q).all()) and bool(torch.isfinite(off_q).all())):
        raise ValueError(f"weight has non-finite values or a range {scale_dtype} scales cannot hold")
    q = torch.round((w - off) / s_q.to(torch.float32).unsqueeze(-1)).clamp(0, MAXQ).to(torch.uint8)
    return Int4Weight(
        qweight=pack_int4(q.view(n, k).t()),
        scales=s_q.t().contiguous(),
        offsets=off_q.t().contiguous(),
        group_size=group_size,
        shape=(n, k),
    )


def _dequant_kn(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantized weight in packed-row order, [K, N] (transposed, permuted if act-order).

    q * scale + offset is computed in float32 (float64 if asked) and rounded once to
    `dtype`; q * scale is exact there for fp16 / bf16 scales.
    """
    n, k = w.shape
    g = w.group_size
    work = torch.float64 if dtype == torch.float64 else torch.float32
    out = unpack_int4(w.qweight).to(work).view(k // g, g, n)
    out.mul_(w.scales.to(work).unsqueeze(1)).add_(w.offsets.to(work).unsqueeze(1))
    return out.view(k, n).to(dtype)


def dequantize_int4(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [N, K] weight in the original input-channel order."""
    wt = _dequant_kn(w, dtype)
    if w.perm is not None:
        unperm = torch.empty_like(wt)
        unperm[w.perm] = wt
        wt = unperm
    return wt.t().contiguous()


# Above this many rows the dequantize-then-one-matmul path is used; below, the
# group-factored path skips the two [K, N] mul/add passes (they dominate at decode).
_FACTORED_MAX_M = 32


def w4a16_matmul_ref(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [..., K]; fp32 math, result in x.dtype.

    Small M: y = sum_g s_g * (x_g @ q_g) + sum(x_g) * b_g (one batched matmul over
    groups on the raw codes, the offset term one [M, K/G] @ [K/G, N] matmul); large M:
    dequantize once and do one matmul.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.float32)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    m = x2.shape[0]
    g = w.group_size
    if m <= _FACTORED_MAX_M:
        ng = k // g
        q = unpack_int4(w.qweight).to(torch.float32).view(ng, g, n)
        xg = x2.view(m, ng, g)
        part = torch.bmm(xg.transpose(0, 1), q)  # [ng, m, n]
        part.mul_(w.scales.to(torch.float32).unsqueeze(1))
        y = part.sum(0).addmm_(xg.sum(-1), w.offsets.to(torch.float32))
    else:
        y = x2 @ _dequant_kn(w)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).view(*lead, n)
