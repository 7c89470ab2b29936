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

Launch scaffolding (split-K for decode-sized M with a deterministic reduction, timed
config choice, tile order) is shared with the FP8 kernel in `triton/gemm.py`. At M <= 4 the
first candidates are `triton/gemv.py`'s GEMV (variant "gemv": the codes decoded in registers and
multiplied with FMAs, no tensor cores; split-K reduced in the same launch), the untimed default
there; the tiles here follow them in the timed choice. Under
TRITON_INTERPRET=1 the dot runs in fp32, because the numpy interpreter stores bf16 as
raw uint16 and would multiply the bit patterns.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..int4 import Int4Weight
from .gemm import (
    GemmConfig,
    bucket_m,
    check_activations,
    grouped_tile,
    interpreter_tile,
    interpreting,
    launch_splitk_reduce,
    plan_split,
    split_k_range,
    store_tile,
    timed_choice,
)
from .gemv import GEMV, MAX_M, gemv_block_m, w4a16_gemv


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_sg, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin, k_end = split_k_range(pid_k, K, k_per_split)
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

    store_tile(acc, out_ptr, bias_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, stride_om, stride_os,
               HAS_BIAS, SPLIT)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, o_ptr, out_ptr, N, K, group_size, stride_qk, stride_sg, stride_ok,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dense [K, N] weight (W^T, packed-row order) in out's dtype: each program expands
    BLOCK_R packed rows (8 * BLOCK_R input channels, inside one group) of BLOCK_N columns."""
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    packed = tl.load(qw_ptr + offs_r[:, None] * stride_qk + offs_n[None, :], mask=mask_n[None, :], other=0)
    codes = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    codes = tl.reshape(codes, (BLOCK_R * 8, BLOCK_N))  # row 8r + j <- nibble j of row r
    g = (pid_r * BLOCK_R * 8) // group_size
    scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    offset = tl.load(o_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    value = codes.to(tl.float32) * scale[None, :] + offset[None, :]
    offs_k = pid_r * BLOCK_R * 8 + tl.arange(0, BLOCK_R * 8)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], value.to(out_ptr.dtype.element_ty),
             mask=mask_n[None, :])


def dequantize_int4_triton(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """W^T as a dense [K, N] tensor in `dtype` (packed-row order, as the kernel multiplies
    it): one pass over the packed weight."""
    n, k = w.shape
    out = torch.empty((k, n), dtype=dtype, device=w.qweight.device)
    rows = min(16, w.group_size // 8)
    block_n = 128
    scales, offsets = w.scales.contiguous(), w.offsets.contiguous()
    _dequant_kernel[(k // 8 // rows, triton.cdiv(n, block_n))](
        w.qweight, scales, offsets, out, n, k, w.group_size, w.qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_R=rows, BLOCK_N=block_n, num_warps=4)
    return out


# ------------------------------------------------------------------ launch helpers

DEQUANT_MATMUL = GemmConfig(0, 0, 0, variant="dequant")
"""The candidate for prompt-sized M: the weight dequantized to the activation dtype in one
pass, then one cuBLAS matmul (bound by arithmetic there, where our tiles spend it on
unpacking every weight once per row tile)."""

def _fit_block_k(bk: int, group_size: int, k: int) -> int:
    while bk > 16 and (group_size % bk or k % bk):
        bk //= 2
    return bk


GEMV_TILES = {
    1: [(512, 32, 4), (1024, 32, 8), (512, 64, 4), (256, 32, 2)],
    2: [(512, 32, 4), (1024, 32, 8), (512, 64, 4), (256, 32, 2)],
    4: [(512, 16, 4), (1024, 16, 8), (256, 16, 2)],  # BLOCK_K 32 here: 255 registers on sm_89
}
"""BLOCK_M -> (BLOCK_N, BLOCK_K, warps) of the GEMV candidates at M <= 4 (`triton/gemv.py`), the
first the untimed default. BLOCK_N is 128 x warps (every warp along N, no layout conversion in
the loop); each thread holds the x tile, so BLOCK_K is smaller at BLOCK_M 4. BLOCK_K shrinks to
fit the group; the split is `choose_split_k`'s (~2 programs per SM)."""


def _candidates(m: int, n: int, k: int, group_size: int) -> List[GemmConfig]:
    if interpreting():
        bm, bn = interpreter_tile(m, n)
        return [GemmConfig(bm, bn, _fit_block_k(128, group_size, k), split_k=1)]
    gemv: List[GemmConfig] = []
    if m <= MAX_M:  # decode-sized: the GEMV kernel first, then the tensor-core tiles
        bm = gemv_block_m(m)
        for bn, bk, warps in GEMV_TILES[bm]:
            cfg = GemmConfig(bm, bn, _fit_block_k(bk, group_size, k), warps, 2, variant=GEMV)
            if cfg not in gemv:
                gemv.append(cfg)
    if m <= 16:
        raw = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4), (16, 128, 64, 4, 4),
               (16, 128, 128, 4, 5), (16, 256, 64, 8, 4)]
    elif m <= 64:
        raw = [(32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (32, 128, 128, 4, 3)]
    else:
        # (128, 128, 128) with 2 stages: 3 stages need 112 KiB of shared memory, over sm_89's 99 KiB
        raw = [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2)]
    out = [DEQUANT_MATMUL] if m > 64 else gemv
    for bm, bn, bk, warps, stages in raw:
        cfg = GemmConfig(bm, bn, _fit_block_k(bk, group_size, k), warps, stages)
        if cfg not in out:
            out.append(cfg)
    if m <= 16:  # whole-K tiles narrow enough to give every SM one: no partials, no reduction kernel
        for bn in (32, 64):
            cfg = GemmConfig(16, bn, _fit_block_k(128, group_size, k), 4, 5, split_k=1)
            if cfg not in out:
                out.append(cfg)
    return out


def _launch(x2: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor], out: torch.Tensor,
            cfg: GemmConfig) -> torch.Tensor:
    """The product into `out` (our kernel) or a new tensor (DEQUANT_MATMUL); returns it."""
    if cfg.variant == "dequant":
        y = x2 @ dequantize_int4_triton(w, x2.dtype)
        return y if bias is None else y.add_(bias.to(y.dtype))
    if cfg.variant == GEMV:
        return w4a16_gemv(x2, w, bias, out, cfg)
    m, k = x2.shape
    n = w.out_features
    bk = cfg.block_k
    if w.group_size % bk or k % bk or bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_k={bk} must be a power of two >= 16 dividing group_size={w.group_size}")
    tiles, split, k_per_split, dst = plan_split(cfg, m, n, k, out)
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
    return out


def w4a16_matmul_triton(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
                        *, config: Optional[GemmConfig] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [..., K] in bf16/fp16; returns x.dtype [..., N]."""
    n, k = w.shape
    check_activations(x, k, "w4a16_matmul_triton")
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
        key = ("w4a16", x.device, bucket_m(m), n, k, w.group_size, x.dtype, bias is not None)
        config = timed_choice(key, _candidates(m, n, k, w.group_size),
                              lambda c: _launch(x2, w, bias, out, c))
    return _launch(x2, w, bias, out, config).view(*lead, n)
