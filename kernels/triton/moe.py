"""Fused mixture-of-experts MLP in Triton: two grouped GEMMs over the tokens sorted by expert.

Same layout and result as `fused_moe_ref` (kernels/moe.py), within rounding.

Past 300 lines on purpose: the two kernels share one K-tile step (`_accumulate`, every weight
form) and the launcher's operand plumbing and tile choice; split, each half would need the other's
private constexpr conventions.

1. Align (`align_by_expert`, torch ops on the device, no host sync: CUDA graphs can hold it).
   The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of
   BLOCK_M, so that every BLOCK_M rows of the sorted list belong to one expert: `sorted_pairs`
   (padding rows hold num_pairs, an invalid pair), `block_experts` (each block's expert; -1 past
   the last). The grid is the worst case, num_pairs + experts x (BLOCK_M - 1) rows; blocks past
   the real ones exit at once.
2. `_moe_gate_up_kernel`: each program takes one block of rows (one expert) and BLOCK_N of the
   expert's intermediate channels, and multiplies the rows' tokens by both the gate rows and the
   up rows of that expert's w13 (two accumulators), so silu(gate) * up is formed in registers and
   only the activation [num_pairs, inter] is written (no [num_pairs, 2 * inter] buffer).
3. `_moe_down_kernel`: the activation rows by the expert's w2, times each pair's routing weight,
   into [num_pairs, hidden] in the model dtype.
4. The k slots of each token are summed in float32 and rounded once (torch).

Biased experts with gpt-oss's clamped SwiGLU (constexprs HAS_BIAS, CLAMPED_SWIGLU; alpha and limit
runtime floats): each projection's bias is added in the model dtype to its rounded product, before
the activation (gate / up) or the routing weight (down), as the reference adds them.

FP8 experts (W8A16, constexpr W_FP8: 1 the hardware's e4m3 conversion from sm_89, 2 decoded
with integer ops before it, as the attention kernel's fp8 KV): the e4m3 tiles are converted
exactly to the activations' dtype for the dot, and each output channel's scale multiplies the
float32 accumulator (a channel's scale factors out of its sum over k); with group scales
(block-wise checkpoints, constexpr GROUPED) each K tile's product is scaled by its group's before
it joins the accumulator. int8 experts (W8A16 checkpoints, W_FP8 3) take the same path, their
codes converted to the activations' dtype as they are (exact). MXFP4 experts (gpt-oss, W_FP8 4,
GROUPED): a K tile of bytes expanded to e2m1 codes, decoded exactly to the activations' dtype, and
each 32-input block's product scaled by its e8m0 power of two (BLOCK_K 32).

INT4 experts (W4A16, constexpr W_INT4; AWQ / GPTQ / compressed-tensors experts, or quantized on
load): a K tile of packed rows is expanded to raw codes 0..15 (exact in 16 bits) for the dot, and,
as in the dense W4A16 kernel (triton/int4.py), the product is scaled by the group's scales and the
tile's row sums times the group's offsets added (W = code * scale + offset within a group).
Grouped forms cut BLOCK_K to divide the group, so that a K tile lies in one group.

Tiles (`_candidates`): untimed, BLOCK_M 16 for decode-sized batches (few rows per expert), 64 once
the average expert gets that many rows, BLOCK_N 64, BLOCK_K 64 (or the group's largest
power-of-two divisor), 4 warps, 2 stages; on a GPU `timed_choice` (triton/gemm.py: once per shape
and row-count bucket, kept on disk per GPU model) times those against wider, taller and deeper
tiles of the same regime and keeps the fastest. Interpreter (TRITON_INTERPRET=1, CPU): big tiles,
and the dot operands in float32 (its tl.dot multiplies bfloat16's raw bits).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..moe import ExpertWeights
from ..numerics import cdiv
from .e4m3 import e4m3_to_float, native_fp8
from .gemm import GemmConfig, bucket_m, interpreting, timed_choice


@triton.jit
def _block_of_expert(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert (-1: a block past the last), its rows' pairs, which rows are real,
    and its output columns."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs, tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _weight_tile(tile, W_FP8: tl.constexpr, dtype):
    """A loaded weight tile in the activations' dtype: as is (W_FP8 0; 3: int8 codes, exact), or
    e4m3 bytes converted exactly (1: by the hardware, 2: with integer ops)."""
    if W_FP8 == 1 or W_FP8 == 2:
        w = e4m3_to_float(tile, W_FP8 == 1)
    elif W_FP8 == 3:  # by way of float32: exact, and what the interpreter converts right
        w = tile.to(tl.float32)
    else:
        w = tile
    return w.to(dtype)


@triton.jit
def _e2m1(codes):
    """e2m1 (FP4) codes 0..15 -> their values in float32, exactly: sign, two exponent bits, one
    mantissa bit; 4 x magnitude is 2m (exponent 0) or (2 + m) << exponent."""
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    quadruple = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    value = quadruple.to(tl.float32) * 0.25
    return tl.where(codes >= 8, -value, value)


@triton.jit
def _plus_bias(acc, bias, dtype):
    """acc rounded to `dtype`, plus the bias, rounded to `dtype` (one rounding of the sum of two
    `dtype` values: the model dtype's add, done in float32, which the interpreter also computes
    right), back in float32."""
    return (acc.to(dtype).to(tl.float32) + bias.to(tl.float32)[None, :]).to(dtype).to(tl.float32)


@triton.jit
def _accumulate(acc, a, w, s, o, n, n_ok, k0, k_ok, stride_wr, stride_sn, stride_sg, group_size,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, W_FP8: tl.constexpr,
                W_INT4: tl.constexpr, GROUPED: tl.constexpr):
    """acc plus a (the K tile from k0) times the same K tile of one expert's weight `w` for output
    channels n. A grouped form's tile product is scaled by its group's scales (int4: plus the tile's
    row sums times the group's offsets, as the dense W4A16 kernel factors them), BLOCK_K dividing
    the group; scales at s + n * stride_sn + group * stride_sg, int4 offsets likewise from o."""
    if W_FP8 == 4:  # MXFP4, [N, K / 2] bytes: nibble j of byte r holds input 2r + j; e8m0 scales a 32-block
        rows = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w + n[None, :].to(tl.int64) * stride_wr + rows[:, None], mask=n_ok[None, :], other=0)
        codes = tl.reshape((packed[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        tile = _e2m1(codes.to(tl.int32)).to(a.dtype)
        exponent = tl.load(s + n * stride_sn + (k0 // group_size) * stride_sg, mask=n_ok, other=127)
        scale = tl.exp2(exponent.to(tl.float32) - 127.0)
        if DOT_FP32:
            return acc + tl.dot(a.to(tl.float32), tile.to(tl.float32)) * scale[None, :]
        return acc + tl.dot(a, tile) * scale[None, :]
    if W_INT4:  # packed [K / 8, N]: nibble j of row r holds input 8r + j
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(w + rows[:, None].to(tl.int64) * stride_wr + n[None, :], mask=n_ok[None, :], other=0)
        codes = tl.reshape((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // group_size
        scale = tl.load(s + n * stride_sn + group * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
        offset = tl.load(o + n * stride_sn + group * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
        a32 = a.to(tl.float32)
        if DOT_FP32:
            part = tl.dot(a32, codes.to(tl.float32))
        else:
            part = tl.dot(a, codes.to(a.dtype))
        return acc + part * scale[None, :] + tl.sum(a32, axis=1)[:, None] * offset[None, :]
    k = k0 + tl.arange(0, BLOCK_K)
    tile = _weight_tile(tl.load(w + n[None, :].to(tl.int64) * stride_wr + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                                other=0), W_FP8, a.dtype)
    if DOT_FP32:
        a = a.to(tl.float32)
        tile = tile.to(tl.float32)
    if GROUPED:
        scale = tl.load(s + n * stride_sn + (k0 // group_size) * stride_sg, mask=n_ok, other=0.0)
        return acc + tl.dot(a, tile) * scale[None, :]
    return tl.dot(a, tile, acc)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w13_ptr, scale_ptr, offset_ptr, act_ptr, sorted_pairs_ptr, block_experts_ptr, bias_ptr,
    num_pairs, inter, hidden, top_k, alpha, limit, group_size,
    stride_xm, stride_we, stride_wr, stride_am, stride_se, stride_sn, stride_sg, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    W_FP8: tl.constexpr, HAS_BIAS: tl.constexpr = False, CLAMPED_SWIGLU: tl.constexpr = False,
    W_INT4: tl.constexpr = False, GROUPED: tl.constexpr = False,
):
    expert, pairs, row_ok, n = _block_of_expert(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    tokens = (pairs // top_k).to(tl.int64)
    n_ok = n < inter
    w = w13_ptr + expert.to(tl.int64) * stride_we
    s = scale_ptr + expert.to(tl.int64) * stride_se
    o = offset_ptr + expert.to(tl.int64) * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        gate = _accumulate(gate, a, w, s, o, n, n_ok, k0, k_ok, stride_wr, stride_sn, stride_sg, group_size,
                           BLOCK_K, BLOCK_N, DOT_FP32, W_FP8, W_INT4, GROUPED)
        up = _accumulate(up, a, w, s, o, n + inter, n_ok, k0, k_ok, stride_wr, stride_sn, stride_sg, group_size,
                         BLOCK_K, BLOCK_N, DOT_FP32, W_FP8, W_INT4, GROUPED)
    if W_FP8 and not GROUPED:  # per-channel scales factor out of the sum over k
        gate = gate * tl.load(s + n * stride_sn, mask=n_ok, other=0.0)[None, :]
        up = up * tl.load(s + (inter + n) * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:  # as the reference: the product rounded to the model dtype, + bias, rounded again
        biases = bias_ptr + expert.to(tl.int64) * stride_be
        gate = _plus_bias(gate, tl.load(biases + n, mask=n_ok, other=0.0), act_ptr.dtype.element_ty)
        up = _plus_bias(up, tl.load(biases + inter + n, mask=n_ok, other=0.0), act_ptr.dtype.element_ty)
    if CLAMPED_SWIGLU:  # gpt-oss: (clamp(up) + 1) * gate' * sigmoid(alpha * gate'), gate' = min(gate, limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    out = act_ptr + pairs.to(tl.int64)[:, None] * stride_am + n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr, w2_ptr, scale_ptr, offset_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr, bias_ptr,
    num_pairs, hidden, inter, group_size,
    stride_am, stride_we, stride_wr, stride_om, stride_se, stride_sn, stride_sg, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    W_FP8: tl.constexpr, HAS_BIAS: tl.constexpr = False, W_INT4: tl.constexpr = False, GROUPED: tl.constexpr = False,
):
    expert, pairs, row_ok, n = _block_of_expert(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    rows = pairs.to(tl.int64)
    n_ok = n < hidden
    w = w2_ptr + expert.to(tl.int64) * stride_we
    s = scale_ptr + expert.to(tl.int64) * stride_se
    o = offset_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(act_ptr + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _accumulate(acc, a, w, s, o, n, n_ok, k0, k_ok, stride_wr, stride_sn, stride_sg, group_size,
                          BLOCK_K, BLOCK_N, DOT_FP32, W_FP8, W_INT4, GROUPED)
    if W_FP8 and not GROUPED:
        acc = acc * tl.load(s + n * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:  # before the routing weight, as the reference
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0)
        acc = _plus_bias(acc, bias, out_ptr.dtype.element_ty)
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts) for the kernels (see the module docstring), by device ops
    of fixed shapes: nothing is read back to the host (no bincount, whose size is data's)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within one
    experts_sorted = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts_sorted]
    capacity = num_pairs + num_experts * (block_m - 1)
    capacity = cdiv(capacity, block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts


def _fit_block_k(block_k: int, group_size: int) -> int:
    """`block_k` halved until it divides a grouped form's group (a K tile in one group)."""
    while group_size and group_size % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"grouped expert weights need a group size that is a multiple of 16, got {group_size}")
    return block_k


def _candidates(num_pairs: int, num_experts: int, group_size: int) -> list[GemmConfig]:
    """The tiles to run: first the one launched untimed (the module docstring's), then those
    `timed_choice` tries against it on a GPU, once per shape: wider N tiles, more rows a tile and
    deeper pipelines, each for the decode-sized (few rows an expert) or the prompt-sized regime."""
    if interpreting():
        return [GemmConfig(32, 64, _fit_block_k(64, group_size), 4, 2)]
    decode = num_pairs < 64 * num_experts
    tiles = ([(16, 64, 64, 4, 2), (16, 128, 64, 4, 3), (32, 64, 64, 4, 3), (16, 64, 128, 4, 4)] if decode else
             [(64, 64, 64, 4, 2), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 64, 128, 4, 3)])
    configs: list[GemmConfig] = []
    for m, n, k, warps, stages in tiles:
        config = GemmConfig(m, n, _fit_block_k(k, group_size), warps, stages)
        if config not in configs:
            configs.append(config)
    return configs


class _Operands:
    """One projection's weight, scale and offset tensors and their strides as the kernels take
    them (see `_accumulate`); the unread ones are placeholders."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
                 form: str, placeholder: torch.Tensor):
        self.weight = weight.contiguous().view(torch.uint8) if form == "fp8" else weight.contiguous()  # e4m3 as bytes
        self.scale = placeholder if scale is None else scale.contiguous()
        self.offset = placeholder if offset is None else offset.contiguous()
        if form == "int4":  # [E, K / G, N]
            self.strides = (self.scale.stride(0), 1, self.scale.stride(1))
        elif scale is not None and scale.dim() == 3:  # fp8 / int8 grouped, mxfp4: [E, N, groups]
            self.strides = (self.scale.stride(0), self.scale.stride(1), 1)
        elif scale is not None:  # fp8 / int8 per channel: [E, N]
            self.strides = (self.scale.stride(0), 1, 0)
        else:
            self.strides = (0, 0, 0)


def fused_moe_triton(
    x: torch.Tensor,
    experts: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Triton twin of `fused_moe_ref` (block_m: a row-tile override for tests). The tiles are the
    fastest of `_candidates` for this shape, timed once (`timed_choice`; the first where untimed).
    batch_invariant (`deterministic`): the decode regime's first tile whatever the token count, and
    each token's experts summed one after the other, so a token's output does not depend on the batch."""
    tokens, hidden = x.shape
    if experts.hidden != hidden:
        raise ValueError(f"expert weights of hidden width {experts.hidden} do not match the activations' {hidden}")
    if tokens == 0:
        return torch.zeros_like(x)
    num_pairs = tokens * topk_ids.shape[1]
    if batch_invariant:
        fixed = _candidates(1, experts.num_experts, experts.group_size)[0]
        return _launch(x, experts, topk_weights, topk_ids, fixed, ordered_sum=True)
    candidates = _candidates(num_pairs, experts.num_experts, experts.group_size)
    if block_m is not None:
        return _launch(x, experts, topk_weights, topk_ids, dataclasses.replace(candidates[0], block_m=block_m))
    key = ("moe", x.device, bucket_m(num_pairs), candidates[0].block_m, experts.num_experts, hidden, experts.inter,
           experts.form, experts.group_size, x.dtype, experts.w13_bias is not None, experts.clamped_swiglu is not None)
    config = timed_choice(key, candidates, lambda c: _launch(x, experts, topk_weights, topk_ids, c))
    return _launch(x, experts, topk_weights, topk_ids, config)


def _launch(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            config: GemmConfig, ordered_sum: bool = False) -> torch.Tensor:
    """Both kernels with `config`'s tiles (see the module docstring); ordered_sum: each token's
    top-k outputs added in order by elementwise adds (torch's reduction over them may group the
    adds by the batch's size)."""
    tokens, hidden = x.shape
    num_experts, inter, form = experts.num_experts, experts.inter, experts.form
    top_k = topk_ids.shape[1]
    x = x.contiguous()
    w13 = _Operands(experts.w13, experts.w13_scale, experts.w13_offset, form, topk_weights)
    w2 = _Operands(experts.w2, experts.w2_scale, experts.w2_offset, form, topk_weights)
    w_fp8 = {"fp8": 1 if native_fp8(x.device) else 2, "int8": 3, "mxfp4": 4}.get(form, 0)
    grouped = form in ("fp8", "int8", "mxfp4") and experts.group_size > 0
    num_pairs = tokens * top_k
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    act = x.new_empty((num_pairs, inter))
    partial = x.new_empty((num_pairs, hidden))
    blocks = block_experts.numel()
    dot_fp32 = interpreting() or x.dtype == torch.float32
    has_bias = experts.w13_bias is not None
    b13 = experts.w13_bias.to(x.dtype).contiguous() if experts.w13_bias is not None else x  # x: unread placeholder
    b2 = experts.w2_bias.to(x.dtype).contiguous() if experts.w2_bias is not None else x
    alpha, limit = experts.clamped_swiglu or (1.0, 0.0)
    forms = dict(W_FP8=w_fp8, W_INT4=form == "int4", GROUPED=grouped)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    _moe_gate_up_kernel[(blocks, cdiv(inter, block_n))](
        x, w13.weight, w13.scale, w13.offset, act, sorted_pairs, block_experts, b13,
        num_pairs, inter, hidden, top_k, alpha, limit, experts.group_size,
        x.stride(0), w13.weight.stride(0), w13.weight.stride(1), act.stride(0), *w13.strides, b13.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_fp32,
        HAS_BIAS=has_bias, CLAMPED_SWIGLU=experts.clamped_swiglu is not None, **forms, **launch,
    )
    _moe_down_kernel[(blocks, cdiv(hidden, block_n))](
        act, w2.weight, w2.scale, w2.offset, partial, weights, sorted_pairs, block_experts, b2,
        num_pairs, hidden, inter, experts.group_size,
        act.stride(0), w2.weight.stride(0), w2.weight.stride(1), partial.stride(0), *w2.strides, b2.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_fp32, HAS_BIAS=has_bias, **forms, **launch,
    )
    per_choice = partial.view(tokens, top_k, hidden)
    if not ordered_sum:
        return per_choice.sum(1, dtype=torch.float32).to(x.dtype)
    total = per_choice[:, 0].float()
    for j in range(1, top_k):
        total += per_choice[:, j]
    return total.to(x.dtype)


__all__ = ["align_by_expert", "fused_moe_triton"]
