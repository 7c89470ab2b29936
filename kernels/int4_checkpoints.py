"""AWQ (GEMM), GPTQ and compressed-tensors (pack-quantized) 4-bit checkpoint tensors -> our packed
`Int4Weight` layout.

Kept apart from kernels/int4.py (our layout, quantizer and reference matmul): these
are one-time load-time conversions from other tools' bit orders, bounded by the one
rounding documented in `offsets_from_zeros`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .int4 import PACK, Int4Weight, pack_int4, unpack_int4

# AutoAWQ GEMM packs along the output dim and, inside each int32, nibble i holds
# column 8c + AWQ_ORDER[i]. Source: AutoAWQ awq/modules/linear/gemm.py
# (WQLinear_GEMM.from_linear, `order_map = [0, 2, 4, 6, 1, 3, 5, 7]`, qweight
# [in, out // 8], qzeros [in // G, out // 8], scales [in // G, out] fp16, zeros
# stored as is, dequant (q - z) * s); vLLM's awq_triton uses the inverse order
# [0, 4, 1, 5, 2, 6, 3, 7] to unpack.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_along_last(packed: torch.Tensor, order=None, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] words of `bits`-wide fields -> uint8 [R, (32 / bits) C]: column (32 / bits) c +
    order[i] <- field i (bits i * bits upward) of packed[:, c]. 4-bit: every format here; 8-bit:
    compressed-tensors' W8A16 (checkpoints/prequantized.py)."""
    r, c = packed.shape
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    fields = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)  # [R, C, per_word], by field i
    if order is not None:
        inv = [0] * per_word
        for i, col in enumerate(order):
            inv[col] = i  # column col lives in field inv[col]
        fields = fields[..., inv]
    return fields.reshape(r, c * per_word)


def offsets_from_zeros(zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Integer zero points -> offsets: -zero * scale in float32, cast (round to nearest)
    to the scales' dtype.

    The product is exact in float32 for fp16 / bf16 scales (zero <= 16), so the cast is
    the only rounding: |offset + zero * scale| <= u * zero * scale with u = 2^-11 (fp16),
    2^-8 (bf16), 2^-24 (fp32 scales: there the product rounds, the cast does not), or
    half the dtype's smallest subnormal where zero * scale is below its normal range.
    With fp16 scales (AWQ, GPTQ) that is at most scale / 128 per weight, a constant
    shift of each group against the checkpoint's own rounding error of up to scale / 2.
    Pass `scales.float()` to a loader for exact offsets (and 4-byte scales).
    """
    off = -(zeros.to(torch.float32) * scales.to(torch.float32))
    out = off.to(scales.dtype)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"zero * scale overflows {scales.dtype}")
    return out.contiguous()


def int4_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int = 128) -> Int4Weight:
    """AutoAWQ GEMM checkpoint tensors -> Int4Weight.

    AWQ: qweight int32 [K, N // 8] packed along N with the AWQ_ORDER interleave,
    qzeros int32 [K // G, N // 8] packed the same way (zeros stored as is),
    scales fp16 [K // G, N]; W = (q - z) * s. (GEMV-format AWQ checkpoints, which
    pack along K with a different interleave, are not handled.) The zeros become
    offsets = -z * s in the scales' dtype (`offsets_from_zeros`: one rounding, bounded
    there); codes and scales are kept bit for bit.
    """
    qweight, qzeros = qweight.to(torch.int32), qzeros.to(torch.int32)
    k, n8 = qweight.shape
    n = n8 * PACK
    if group_size == -1:
        group_size = k
    if k % group_size or k % PACK:
        raise ValueError(f"AWQ qweight rows K={k} must be divisible by group_size={group_size} and 8")
    ng = k // group_size
    if tuple(qzeros.shape) != (ng, n8) or tuple(scales.shape) != (ng, n):
        raise ValueError(f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}, group_size {group_size}")
    q = unpack_along_last(qweight, AWQ_ORDER)  # [K, N]
    z = unpack_along_last(qzeros, AWQ_ORDER)  # [ng, N]
    return Int4Weight(qweight=pack_int4(q), scales=scales.contiguous(), offsets=offsets_from_zeros(z, scales),
                      group_size=group_size, shape=(n, k))


def int4_from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: Optional[torch.Tensor] = None, group_size: int = 128,
                   checkpoint_format: str = "gptq") -> Int4Weight:
    """GPTQ 4-bit checkpoint tensors -> Int4Weight.

    GPTQ (AutoGPTQ QuantLinear.pack): qweight int32 [K // 8, N] packed sequentially along
    K (nibble j of row r <- input 8r + j) -- exactly our layout; qzeros int32
    [K // G, N // 8] packed sequentially along N; scales fp16 [K // G, N]; g_idx [K]
    group of each input channel. The v1 format ("gptq") stores zero - 1 and readers
    add 1 back, so a stored 15 reads as 16 (we keep that: offset -16 * s); "gptq_v2"
    (GPTQModel) stores the zero itself. Symmetric checkpoints are the case z = 8. The
    zeros become offsets = -z * s in the scales' dtype (`offsets_from_zeros`: one
    rounding, bounded there); codes and scales are kept bit for bit.

    Act-order (desc_act) checkpoints, whose g_idx is not k // G, are handled when every
    group has exactly G members: input rows are reordered so groups are contiguous and
    the permutation is kept in `perm`. Any other g_idx is rejected.
    """
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    qweight, qzeros = qweight.to(torch.int32), qzeros.to(torch.int32)
    k8, n = qweight.shape
    k = k8 * PACK
    if group_size == -1:
        group_size = k
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    ng = k // group_size
    if tuple(qzeros.shape) != (ng, n // PACK) or tuple(scales.shape) != (ng, n) or n % PACK:
        raise ValueError(f"GPTQ shapes disagree (4-bit expected): qweight {tuple(qweight.shape)}, "
                         f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group_size {group_size}")
    z = unpack_along_last(qzeros)
    if checkpoint_format == "gptq":
        z = z + 1  # uint8: 15 + 1 = 16 fits
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"g_idx must have shape [{k}]")
        trivial = torch.arange(k, device=g_idx.device) // group_size
        if not torch.equal(g_idx, trivial):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], trivial):
                raise ValueError("g_idx does not split the inputs into groups of exactly group_size "
                                 "channels; this layout cannot be represented")
            qweight = pack_int4(unpack_int4(qweight)[perm])
    return Int4Weight(qweight=qweight.contiguous(), scales=scales.contiguous(),
                      offsets=offsets_from_zeros(z, scales), group_size=group_size, shape=(n, k), perm=perm)


def int4_from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                 weight_zero_point: Optional[torch.Tensor] = None) -> Int4Weight:
    """compressed-tensors' pack-quantized 4-bit tensors (llm-compressor's W4A16) -> Int4Weight.

    compressed-tensors (`pack_to_int32`): weight_packed int32 [N, ceil(K / 8)] packed along K (nibble i
    of word c holds input 8c + i) with the signed codes offset by 8 (stored 0..15); weight_scale
    [N, K // G] (one column for the channel strategy: G = K); weight_zero_point, asymmetric schemes only,
    int32 [ceil(N / 8), K // G] packed the same way along N. W = (stored - zero) * scale, the zero 8
    where there is none. The zeros become offsets = -zero * scale in the scales' dtype (one rounding,
    `offsets_from_zeros`); codes and scales are kept bit for bit.
    """
    n, groups = weight_scale.shape
    codes = unpack_along_last(weight_packed.to(torch.int32))  # [N, 8 * ceil(K / 8)]
    k = codes.shape[1]
    if n != weight_packed.shape[0] or k % groups or (k // groups) % PACK:
        raise ValueError(f"compressed-tensors shapes disagree: weight_packed {tuple(weight_packed.shape)}, "
                         f"weight_scale {tuple(weight_scale.shape)} (4-bit, groups of a multiple of 8 inputs expected)")
    scales = weight_scale.t().contiguous()  # [K // G, N]
    if weight_zero_point is None:
        zeros = torch.full_like(scales, 8, dtype=torch.uint8)
    else:
        zeros = unpack_along_last(weight_zero_point.to(torch.int32).t().contiguous())[:, :n]  # [K // G, N]
    return Int4Weight(qweight=pack_int4(codes.t()), scales=scales, offsets=offsets_from_zeros(zeros, scales),
                      group_size=k // groups, shape=(n, k))
