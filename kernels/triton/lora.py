"""Batched LoRA in Triton: two grouped GEMMs over the tokens sorted by adapter slot (SGMV, as
punica and S-LoRA call it).

Same layout and result as `add_lora_ref` (kernels/lora.py), within rounding.

1. Align: the tokens are grouped by slot with the fused MoE kernel's `align_by_expert` (device ops,
   no host sync, so a CUDA graph can hold it), the tokens without an adapter as one more group
   that the kernels skip. Every BLOCK_M rows of the sorted list then belong to one slot.
2. `_lora_shrink_kernel`: each program takes one block of rows (one slot) and BLOCK_R of the
   slot's rank, x[rows] @ a[slot]^T, rounded to x.dtype as PEFT's lora_A output is.
3. `_lora_expand_kernel`: those rows by b[slot]^T for BLOCK_N output channels, rounded, times the
   slot's scaling, rounded, added to the base output in place (each token is in one row, so no
   two programs write one element).

Tiles: BLOCK_M 16 for decode-sized batches, 64 once the average slot gets that many rows;
BLOCK_R / BLOCK_K the rank rounded up to a power of two (16..64); BLOCK_N 64, BLOCK_K 64 along
the input, where this GPU has no committed choice (`triton/tuned.py`). Interpreter
(TRITON_INTERPRET=1, CPU): the dot operands in float32 (its tl.dot multiplies bfloat16's raw bits).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..numerics import cdiv
from .gemm import GemmConfig, bucket_m, interpreting
from .moe import align_by_expert
from .tuned import choice


@triton.jit
def _rows_of_slot(sorted_rows_ptr, block_slots_ptr, num_tokens, num_slots, BLOCK_M: tl.constexpr):
    """This program's slot (-1 where it has nothing to do: past the last block, or the tokens
    without an adapter), its rows and which of them are real."""
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    slot = tl.where(slot < num_slots, slot, -1)
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return slot, rows.to(tl.int64), rows < num_tokens


@triton.jit
def _rows_times_weight(acc, x_ptr, rows, row_ok, stride_xm, w_ptr, n, n_ok, stride_wn, width,
                       BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x[rows, :width] @ w[n, :width]^T: both kernels' loop (the shrink's w is a slot's A, n
    its rank columns; the expand's w a slot's B, n its output rows)."""
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0).to(xs.dtype)
        if DOT_FP32:
            xs = xs.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(xs, w, acc)
    return acc


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, shrunk_ptr, sorted_rows_ptr, block_slots_ptr,
    num_tokens, num_slots, rank, width,
    stride_xm, stride_as, stride_ar, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    slot, rows, row_ok = _rows_of_slot(sorted_rows_ptr, block_slots_ptr, num_tokens, num_slots, BLOCK_M)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rank
    acc = _rows_times_weight(tl.zeros([BLOCK_M, BLOCK_R], tl.float32), x_ptr, rows, row_ok, stride_xm,
                             a_ptr + slot.to(tl.int64) * stride_as, r, r_ok, stride_ar, width, BLOCK_K, DOT_FP32)
    tl.store(shrunk_ptr + rows[:, None] * stride_sm + r[None, :], acc.to(shrunk_ptr.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr, b_ptr, scaling_ptr, out_ptr, sorted_rows_ptr, block_slots_ptr,
    num_tokens, num_slots, rank, width,
    stride_sm, stride_bs, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    slot, rows, row_ok = _rows_of_slot(sorted_rows_ptr, block_slots_ptr, num_tokens, num_slots, BLOCK_M)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width
    acc = _rows_times_weight(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), shrunk_ptr, rows, row_ok, stride_sm,
                             b_ptr + slot.to(tl.int64) * stride_bs, n, n_ok, stride_bn, rank, BLOCK_K, DOT_FP32)
    dtype = out_ptr.dtype.element_ty
    delta = (acc.to(dtype).to(tl.float32) * tl.load(scaling_ptr + slot)).to(dtype)
    mask = row_ok[:, None] & n_ok[None, :]
    target = out_ptr + rows[:, None] * stride_om + n[None, :]
    base = tl.load(target, mask=mask, other=0.0)
    tl.store(target, (base.to(tl.float32) + delta.to(tl.float32)).to(dtype), mask=mask)


def _rank_tile(rank: int) -> int:
    return min(max(triton.next_power_of_2(rank), 16), 64)


def lora_block_m(num_tokens: int, num_slots: int) -> int:
    """Rows a program takes: few for decode-sized batches, more once slots get many rows."""
    return 16 if num_tokens < 64 * max(num_slots, 1) else 64


def lora_config(num_tokens: int, num_slots: int) -> GemmConfig:
    """The launch without a committed choice: block_m rows a program (`lora_block_m`), the expand
    kernel's BLOCK_N (block_n) and the shrink kernel's BLOCK_K along the input (block_k) 64."""
    return GemmConfig(32 if interpreting() else lora_block_m(num_tokens, num_slots), 64, 64, 4, 2)


def _config(x: torch.Tensor, num_slots: int, rank: int, width_out: int, block_m: int | None) -> GemmConfig:
    """`lora_config`, or this GPU's committed choice (`triton/tuned.py`; never timed here: the
    kernels run inside every adapted linear of a captured decode step), or a test's row tile."""
    default = lora_config(x.shape[0], num_slots)
    if block_m is not None:
        return dataclasses.replace(default, block_m=block_m)
    key = ("lora", x.device, bucket_m(x.shape[0]), default.block_m, num_slots, rank, x.shape[1], width_out, x.dtype)
    return choice(key, [default])


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    block_m: int | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `add_lora_ref` (block_m: a row-tile override for tests; config: the whole
    launch, for the tuning sweep); returns out."""
    num_tokens, width_in = x.shape
    num_slots, rank = a.shape[0], a.shape[1]
    width_out = out.shape[1]
    if a.shape[2] != width_in or b.shape != (num_slots, width_out, rank) or out.shape[0] != num_tokens:
        raise ValueError(f"LoRA stacks {tuple(a.shape)} / {tuple(b.shape)} do not match x {tuple(x.shape)} "
                         f"and out {tuple(out.shape)}")
    if out.stride(1) != 1:
        raise ValueError("the base output must have contiguous rows (the delta is added in place)")
    if num_tokens == 0:
        return out
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    config = config or _config(x, num_slots, rank, width_out, block_m)
    block_m = config.block_m
    ids = torch.where(token_slots < 0, num_slots, token_slots.to(torch.int64))
    sorted_rows, block_slots = align_by_expert(ids[:, None], num_slots + 1, block_m)
    blocks = block_slots.numel()
    dot_fp32 = interpreting() or x.dtype == torch.float32
    shrunk = x.new_empty((num_tokens, rank))
    block_r = _rank_tile(rank)
    _lora_shrink_kernel[(blocks, cdiv(rank, block_r))](
        x, a, shrunk, sorted_rows, block_slots,
        num_tokens, num_slots, rank, width_in,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=config.block_k, DOT_FP32=dot_fp32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    _lora_expand_kernel[(blocks, cdiv(width_out, config.block_n))](
        shrunk, b, scaling, out, sorted_rows, block_slots,
        num_tokens, num_slots, rank, width_out,
        shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_r, DOT_FP32=dot_fp32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


__all__ = ["add_lora_triton", "lora_block_m", "lora_config"]
