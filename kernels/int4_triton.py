"""W4A16 GEMM in Triton: y = x @ W^T with W stored as packed INT4 (see `int4.py`).

Dequantization is factored out of the inner product: a K-tile of BLOCK_K // 8 packed
int32 rows is loaded once, its nibbles are expanded with shifts into a [BLOCK_K,
BLOCK_N] tile of raw codes (integers 0..15, exact in fp16/bf16) and fed to the tensor
cores as is. Within one group W = q * s + b, so

  sum_k x_k * W[n, k] = s_n * (x . q_n) + b_n * sum_k x_k

and the [BLOCK_M, BLOCK_N] partial product is scaled and the offset term (one fp32 row
sum of the x tile times the group's offsets) added afterwards (BLOCK_K divides the
group size, so a K-tile sits in one group). No dequantized weight is ever rounded to
the activation dtype. Accumulation is fp32, which also absorbs the cancellation between
the two terms for groups far from 0 (|b| >> 15 s; tested with such groups). Scales and
offsets share one row stride (both made contiguous at launch).

Decode-sized M (and any launch with fewer output tiles than SMs) uses split-K: each
program handles a slice of K and writes an fp32 partial; a second small kernel sums the
partials in a fixed order, adds the bias and casts (deterministic, unlike atomics).

Configs: a handful per regime, timed once per (device, M bucket, N, K, dtype) and cached
(`PAGEDSERVE_AUTOTUNE=0` turns timing off and takes the heuristic's first choice).
Under TRITON_INTERPRET=1 the first config is used and the dot runs in fp32, because the
numpy interpreter stores bf16 as raw uint16 and would multiply the bit patterns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .int4 import Int4Weight


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_sg, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row-tiles share each weight column-tile while it is in L2.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                    mask=mask_m[:, None], other=0.0)
        packed = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :],
                         mask=mask_n[None, :], other=0)
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))  # row 8r + j <- nibble j of row r
        g = k0 // group_size
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        offset = tl.load(o_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        x32 = x.to(tl.float32)
        if DOT_F32:
            part = tl.dot(x32, codes.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, codes.to(x.dtype))
        xsum = tl.sum(x32, axis=1)  # masked rows load as 0, so they add nothing
        acc += part * scale[None, :] + xsum[:, None] * offset[None, :]

    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * stride_os + out_offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum_s part[s] (+ bias), fixed summation order; part is [SPLIT_K, M, N] fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------ launch helpers

@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters; split_k=None lets the heuristic choose."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: Optional[int] = None
    group_m: int = 8


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_split_k(tiles: int, k_iters: int, sms: int) -> int:
    """Enough K-slices to give ~2 programs per SM when the output has few tiles."""
    if tiles >= sms or k_iters <= 1:
        return 1
    split = min(k_iters, -(-2 * sms // tiles), 32)
    return -(-k_iters // -(-k_iters // split))  # drop empty slices


def launch_splitk_reduce(part: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    split, m, n = part.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else part, out, m * n, n,
        SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def timed_choice(cache: Dict, key, candidates: List, run) -> object:
    """Pick the fastest candidate once per key (the small 'autotune' of this package)."""
    if key in cache:
        return cache[key]
    if (len(candidates) == 1 or interpreting() or os.environ.get("PAGEDSERVE_AUTOTUNE", "1") == "0"
            or torch.cuda.is_current_stream_capturing()):
        return candidates[0]
    from triton.testing import do_bench

    best, best_t = candidates[0], float("inf")
    for cand in candidates:
        try:
            t = do_bench(lambda: run(cand), warmup=5, rep=20)
        except Exception:  # e.g. out of shared memory on a smaller GPU
            continue
        if t < best_t:
            best, best_t = cand, t
    cache[key] = best
    return best


def _bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _fit_block_k(bk: int, group_size: int, k: int) -> int:
    while bk > 16 and (group_size % bk or k % bk):
        bk //= 2
    return bk


def _candidates(m: int, n: int, k: int, group_size: int) -> List[GemmConfig]:
    if interpreting():
        # Few, large programs: the numpy interpreter pays per program, not per element.
        bm = 16 if m <= 16 else 32
        bn = max(16, min(64, triton.next_power_of_2(n)))
        return [GemmConfig(bm, bn, _fit_block_k(128, group_size, k), split_k=1)]
    if m <= 16:
        raw = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4), (16, 128, 64, 4, 4)]
    elif m <= 64:
        raw = [(32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (32, 128, 128, 4, 3)]
    else:
        raw = [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3)]
    out = []
    for bm, bn, bk, warps, stages in raw:
        cfg = GemmConfig(bm, bn, _fit_block_k(bk, group_size, k), warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


_TUNED: Dict[Tuple, GemmConfig] = {}


def _launch(x2: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor], out: torch.Tensor,
            cfg: GemmConfig) -> None:
    m, k = x2.shape
    n = w.out_features
    bk = cfg.block_k
    if w.group_size % bk or k % bk or bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_k={bk} must be a power of two >= 16 dividing group_size={w.group_size}")
    k_iters = k // bk
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k if cfg.split_k is not None else choose_split_k(tiles, k_iters, num_sms(x2.device))
    split = max(1, min(split, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * bk
    split = triton.cdiv(k, k_per_split)
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    scales, offsets = w.scales.contiguous(), w.offsets.contiguous()  # no-ops for our own weights
    _w4a16_kernel[(tiles, split)](
        x2, w.qweight, scales, offsets, bias if bias is not None else scales, dst,
        m, n, k, w.group_size, k_per_split,
        x2.stride(0), x2.stride(1), w.qweight.stride(0), scales.stride(0), n, m * n,
        HAS_BIAS=bias is not None, SPLIT=split > 1, DOT_F32=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        launch_splitk_reduce(dst, bias, out)


def w4a16_matmul_triton(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
                        *, config: Optional[GemmConfig] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [..., K] in bf16/fp16; returns x.dtype [..., N]."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w4a16_matmul_triton takes bf16/fp16 activations, got {x.dtype}")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 for CPU)")
    if w.group_size % 16:
        raise ValueError("the Triton kernel needs group_size to be a multiple of 16")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    if config is None:
        key = (x.device, _bucket(m), n, k, w.group_size, x.dtype, bias is not None)
        config = timed_choice(_TUNED, key, _candidates(m, n, k, w.group_size),
                              lambda c: _launch(x2, w, bias, out, c))
    _launch(x2, w, bias, out, config)
    return out.view(*lead, n)
