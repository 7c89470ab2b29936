"""Batch-invariant Triton kernels for `deterministic` on a GPU: a row's result does not depend
on the other rows of its batch.

Greedy decoding turns a difference in the last bit of a logit into another token, and a GPU step
has three sources of such differences beside a request's neighbours: cuBLAS picks its algorithm
(tile shape, split-K) by the row count, torch's row reductions spread a row over more threads when
there are few rows, and our own Triton GEMMs and attention pick tiles and KV splits by batch size.
vLLM's and SGLang's batch-invariant modes remove them the same way these kernels do: everything a
row's arithmetic depends on (tile shape, warp count, the order of the K loop) follows from the
weight's shape, the dtype and the device alone, never from M.

- `matmul`: x [M, K] @ W [N, K]^T (+ bias) with fixed tiles and no split-K: every output sums
  its K tiles from 0 up with one tl.dot shape.
- `rms_norm`: one program a row, the row's sum of squares over the whole row in one tl.sum.
- `log_softmax`: one program a row, chunks of the vocabulary in order.

The attention's invariant launch (fixed tiles, no split over the keys) is paged_attention.py's,
the MoE kernels' a fixed tile in moe.py. Under the interpreter (TRITON_INTERPRET=1) 16-bit dot
operands are upcast to float32 (its tl.dot multiplies bfloat16's raw bits), as in the other kernels.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemm import interpreting

# ------------------------------------------------------------------ kernels


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]): one output tile a program, K in order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_o, eps, offset,
                     ORDER: tl.constexpr, BLOCK: tl.constexpr):
    """One row's RMSNorm in the rounding order of backend/models/llama.py's RMSNorm (ORDER 0: the
    normed row rounded to x's dtype, then times the weight; 1: the weight times the float32 row,
    OLMo 2; 2: the float32 row times offset + weight, Gemma)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ORDER == 0:
        y = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w
    elif ORDER == 1:
        y = w * normed
    else:
        y = normed * (offset + w)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    """One float32 row's log-softmax: each lane's running max and sum over the row's chunks, then
    the lanes combined, then the row less its log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        v = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < N, other=float("-inf"))
        m_new = tl.maximum(m, v)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes with nothing finite yet
        s = s * tl.exp(m - m_safe) + tl.exp(v - m_safe)
        m = m_new
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        v = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * stride_o + start + cols, v - lse, mask=ok)


# ------------------------------------------------------------------ launchers


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: a nominal count


def matmul_tiles(n: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight of N rows: from N, the dtype
    and the device only, never the row count. 32 output columns a tile where 64 would leave SMs idle
    on a decode step (one row tile); float32 takes half the K depth (its tiles are twice the bytes)."""
    if interpreting():
        return 64, 64, 64, 4, 1
    block_n = 64 if triton.cdiv(n, 64) >= _num_sms(device) else 32
    if dtype == torch.float32:
        return 32, block_n, 32, 4, 2
    return 64, block_n, 64, 4, 3


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's sums in one order whatever the row count."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    block_m, block_n, block_k, warps, stages = matmul_tiles(n, x.dtype, x.device)
    _matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, weight, bias if bias is not None else weight, out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        DOT_FP32=interpreting() or x.dtype == torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=warps, num_stages=stages,
    )
    return out.view(*lead, n)


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rounds_once: bool = False,
             offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last axis as backend/models/llama.py's RMSNorm computes it (its `rounds_once`
    and weight `offset`), one row a program; the result's dtype is the one torch's expression gives."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    order = 2 if offset else 1 if rounds_once else 0
    dtype = torch.promote_types(weight.dtype, x.dtype) if order == 0 else x.dtype
    out = torch.empty((x2.shape[0], n), dtype=dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, n, x2.stride(0), out.stride(0), eps,
                                         float(offset), ORDER=order, BLOCK=block, num_warps=_row_warps(block))
    return out.view(*x.shape[:-1], n)


LOG_SOFTMAX_BLOCK = 4096


def log_softmax(rows: torch.Tensor) -> torch.Tensor:
    """rows [R, V] float32 -> their log-softmax over V, one row a program."""
    if rows.dtype != torch.float32 or rows.dim() != 2:
        raise TypeError(f"log_softmax takes float32 rows [R, V], got {rows.dtype} {tuple(rows.shape)}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = min(LOG_SOFTMAX_BLOCK, triton.next_power_of_2(rows.shape[1]))
        _log_softmax_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), out.stride(0),
                                              BLOCK=block, num_warps=_row_warps(block))
    return out


__all__ = ["log_softmax", "matmul", "matmul_tiles", "rms_norm"]
