"""Decode-sized GEMV kernels for quantized weights (M = 1..4 rows), in the manner of GemLite's.

At M <= 4 a product y = x @ W^T reads every weight byte once and does a handful of flops per
byte: it is bound by the weight's read, and the tensor-core tiles of `triton/int4.py` and
`triton/fp8.py` (16 rows, at most 4 of them real) spend their registers, shared memory and
instruction slots on the MMA and on rows that do not exist. Here a program owns BLOCK_N output
columns and one slice of K, decodes its weight tile to fp32 in registers and multiplies it by the
BLOCK_M (1, 2 or 4) activation rows with plain FMAs (no `tl.dot`, no shared memory in the loop):
the registers hold weight bytes in flight and the activations they meet, nothing else.

W4A16 (`_w4a16_gemv_kernel`, `Int4Weight`): a K tile is BLOCK_K // 8 packed int32 rows, loaded
coalesced along N (the layout's contiguous dimension). Nibble j of packed row r is input channel
8r + j, so for each j the codes of the tile form one [BLOCK_K // 8, BLOCK_N] tensor (a shift and a
mask) and meet the activations x[8r + j] in an FMA. A code becomes a float without a conversion
instruction: its bits or'ed into the mantissa of 2^23 make the float 2^23 + q, and one
subtraction gives q exactly. The group algebra is `_w4a16_kernel`'s: within a group W = q s + b,
so a tile (inside one group: BLOCK_K divides the group size) adds s * (x . q) + b * sum(x).
The tiles are as wide as the CTA: BLOCK_N = 4 columns x 32 lanes x num_warps (`triton/int4.py`'s
`GEMV_TILES`). Triton's coalesced layout of the packed tile then puts every warp along N and every
packed row in each thread, so the sums over K never leave a thread, and the [BLOCK_N] scale,
offset and accumulator vectors have that same layout: the loop holds no layout conversion (no
shared memory, no barrier). The price is that each thread holds the whole x tile (BLOCK_K x
BLOCK_M values), hence the smaller BLOCK_K at BLOCK_M = 4.

W8A16 (`_w8a16_gemv_kernel`, `Fp8Weight` e4m3 and `Int8Weight` int8 codes): the weight is
[N, K] with K contiguous, so a program loads a [BLOCK_N, BLOCK_K] byte tile coalesced along K
(16 bytes a thread), decodes it (e4m3 by the hardware conversion where the device has it,
`NATIVE_FP8`, else with integer ops, `decode_e4m3`; int8 codes through the same 2^23 mantissa
trick, exact) and reduces each row's products over the tile (in-thread, then across the few
lanes along K). A channel scale multiplies the fp32 sums once at the end; group scales (GROUP_K)
multiply each K tile's sums (BLOCK_K divides the group), as `_fp8_gemm_kernel` does. The
activations stay 16-bit (no per-token quantization: the weight is the traffic). BLOCK_N and
BLOCK_K stay below the thread count (`triton/fp8.py`'s `GEMV_TILES`): Triton keeps a load of
fewer elements than threads in the layout its consumer wants, so the x and group-scale vectors
load straight into the tile's slices; a load of as many elements as threads gets a coalesced
layout of its own and a conversion through shared memory, with a barrier, every K tile.

Split-K in one launch, deterministic. At M = 1 a 4096-wide layer has 8..64 column tiles: too
few programs to keep 132 SMs reading, so K is split in S slices (grid axis 1; S from
`choose_split_k`, ~2 programs per SM, unless the config fixes it). Each program writes its fp32
partial [BLOCK_M, BLOCK_N] of its slice, then (after a CTA barrier, so that every warp's stores
precede it) increments its output tile's counter with an acq_rel atomic. The program that
arrives last (the atomic returns S - 1) reads the S partials back (through L2) and sums them in
slice order 0..S-1 (eight loads in flight at a time), whichever program came last and whatever
the timing, adds the bias, casts
and stores the output, and sets the counter back to 0 for the next launch. The bits therefore
depend on the config (tile and split), never on the run; no second kernel (the reduction of
`gemm.py`'s split-K) is launched. The counters are one int32 per output tile in a buffer kept
per device (`_counters`), zeroed once when allocated and left at zero by every launch; it is
grown outside CUDA graph capture only (the decode graphs are captured after a warm-up at the
same shapes), and a grown buffer keeps the old one alive, since a graph captured before holds
its address. Launches on one device share the buffer: they must be ordered on one stream (the
engine's case); two streams running GEMVs at once would mix their counts.

Host side: `w4a16_gemv` and `w8a16_gemv` take the launchers' `GemmConfig` (variant "gemv";
block_m is BLOCK_M, 1, 2 or 4, and rows beyond it are covered by grid axis 2). Under
TRITON_INTERPRET=1 the kernels run as written (the programs one after another).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import triton
import triton.language as tl

from ..fp8 import Fp8Weight, Int8Weight
from ..int4 import Int4Weight
from . import gemm
from .e4m3 import decode_e4m3, native_fp8
from .gemm import GemmConfig

GEMV = "gemv"
"""`GemmConfig.variant` of the launches here."""

MAX_M = 4
"""The most rows the launchers send here (BLOCK_M 4): each thread holds BLOCK_M rows of the x tile
and BLOCK_M accumulators, so past 4 rows the tensor-core tiles of int4.py / fp8.py take over."""

MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23: or'ed with an integer 0 <= v < 2^23, the float 2^23 + v
MAGIC_F = tl.constexpr(8388608.0)  # 2^23
REDUCE_UNROLL = tl.constexpr(8)  # partials the last program of a tile loads at once


# ------------------------------------------------------------------ in-kernel helpers

@triton.jit
def _row_mask(row, M, N, offs_n):
    """The columns of output row `row` that exist: none past the last row."""
    return offs_n < tl.where(row < M, N, 0)  # (a vector mask: the interpreter cannot and a scalar into one)


@triton.jit
def _row_pointers(x_ptr, row0, M, stride_xm):
    """The four activation rows a program may multiply, from `row0`: rows past M read row M - 1
    (no mask in the loop); their results are never stored."""
    return (x_ptr + row0 * stride_xm, x_ptr + tl.minimum(row0 + 1, M - 1) * stride_xm,
            x_ptr + tl.minimum(row0 + 2, M - 1) * stride_xm, x_ptr + tl.minimum(row0 + 3, M - 1) * stride_xm)


@triton.jit
def _store_partial(acc, part_ptr, pid_k, row, M, N, offs_n):
    """fp32 partial of K slice `pid_k` for output row `row`: part is [S, M, N]."""
    tl.store(part_ptr + (pid_k * M + row) * N + offs_n, acc, mask=_row_mask(row, M, N, offs_n))


@triton.jit
def _sum_partials(part_ptr, row, M, N, offs_n, num_splits, BLOCK_N: tl.constexpr):
    """The S partials of output row `row`, summed in slice order 0..S-1 (read through L2). The loads
    go out REDUCE_UNROLL at a time (a slice past S reads nothing and adds 0.0, which changes no
    bits), so one program reads S partials in S / REDUCE_UNROLL round trips to L2, not S."""
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    columns = tl.where(row < M, N, 0)
    for s0 in range(0, num_splits, REDUCE_UNROLL):
        for i in tl.static_range(REDUCE_UNROLL):
            s = s0 + i
            mask = offs_n < tl.where(s < num_splits, columns, 0)
            total += tl.load(part_ptr + (s * M + row) * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_row(y, out_ptr, bias_ptr, row, M, N, offs_n, stride_om, HAS_BIAS: tl.constexpr):
    """Output row `row`: y (+ bias) cast to the output dtype."""
    mask = _row_mask(row, M, N, offs_n)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(y0, y1, y2, y3, row0, pid_k, tile, part_ptr, count_ptr, bias_ptr, out_ptr,
              M, N, offs_n, num_splits, stride_om,
              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows row0 .. row0 + BLOCK_M - 1 of the output tile: stored directly without split-K; under
    SPLIT the partials, then the last program of the tile to arrive sums the slices in order."""
    if SPLIT:
        _store_partial(y0, part_ptr, pid_k, row0, M, N, offs_n)
        if BLOCK_M > 1:
            _store_partial(y1, part_ptr, pid_k, row0 + 1, M, N, offs_n)
        if BLOCK_M > 2:
            _store_partial(y2, part_ptr, pid_k, row0 + 2, M, N, offs_n)
            _store_partial(y3, part_ptr, pid_k, row0 + 3, M, N, offs_n)
        tl.debug_barrier()  # every warp's partial is stored before the release below
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last slice of this tile: all partials are visible
            y0 = _sum_partials(part_ptr, row0, M, N, offs_n, num_splits, BLOCK_N)
            _store_row(y0, out_ptr, bias_ptr, row0, M, N, offs_n, stride_om, HAS_BIAS)
            if BLOCK_M > 1:
                y1 = _sum_partials(part_ptr, row0 + 1, M, N, offs_n, num_splits, BLOCK_N)
                _store_row(y1, out_ptr, bias_ptr, row0 + 1, M, N, offs_n, stride_om, HAS_BIAS)
            if BLOCK_M > 2:
                y2 = _sum_partials(part_ptr, row0 + 2, M, N, offs_n, num_splits, BLOCK_N)
                _store_row(y2, out_ptr, bias_ptr, row0 + 2, M, N, offs_n, stride_om, HAS_BIAS)
                y3 = _sum_partials(part_ptr, row0 + 3, M, N, offs_n, num_splits, BLOCK_N)
                _store_row(y3, out_ptr, bias_ptr, row0 + 3, M, N, offs_n, stride_om, HAS_BIAS)
            tl.store(count_ptr + tile, 0)  # ready for the next launch (ordered after this one on the stream)
    else:
        _store_row(y0, out_ptr, bias_ptr, row0, M, N, offs_n, stride_om, HAS_BIAS)
        if BLOCK_M > 1:
            _store_row(y1, out_ptr, bias_ptr, row0 + 1, M, N, offs_n, stride_om, HAS_BIAS)
        if BLOCK_M > 2:
            _store_row(y2, out_ptr, bias_ptr, row0 + 2, M, N, offs_n, stride_om, HAS_BIAS)
            _store_row(y3, out_ptr, bias_ptr, row0 + 3, M, N, offs_n, stride_om, HAS_BIAS)


# ------------------------------------------------------------------ W4A16

@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, o_ptr, bias_ptr, part_ptr, count_ptr, out_ptr,
    M, N, K, group_size, k_per_split, num_splits,
    stride_xm, stride_xk, stride_qk, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_K // 8  # packed int32 rows of a K tile
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, ROWS)
    row0 = pid_m * BLOCK_M
    xr0, xr1, xr2, xr3 = _row_pointers(x_ptr, row0, M, stride_xm)

    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum over the slice's tiles of s * (x . q) + b * sum(x)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_begin, k_end = gemm.split_k_range(pid_k, K, k_per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        packed = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :],
                         mask=mask_n[None, :], other=0)
        g = k0 // group_size  # the tile lies inside one group
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        offset = tl.load(o_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        xq0 = tl.zeros((BLOCK_N,), dtype=tl.float32)  # x . q over the tile
        xq1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        xq2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        xq3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        xs0 = tl.zeros((ROWS,), dtype=tl.float32)  # sum of x, per packed row
        xs1 = tl.zeros((ROWS,), dtype=tl.float32)
        xs2 = tl.zeros((ROWS,), dtype=tl.float32)
        xs3 = tl.zeros((ROWS,), dtype=tl.float32)
        for j in tl.static_range(8):
            q = (((packed >> (4 * j)) & 0xF) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_F  # exact code
            x_offs = (k0 + offs_r * 8 + j) * stride_xk
            x0 = tl.load(xr0 + x_offs).to(tl.float32)
            xq0 += tl.sum(q * x0[:, None], axis=0)
            xs0 += x0
            if BLOCK_M > 1:
                x1 = tl.load(xr1 + x_offs).to(tl.float32)
                xq1 += tl.sum(q * x1[:, None], axis=0)
                xs1 += x1
            if BLOCK_M > 2:
                x2 = tl.load(xr2 + x_offs).to(tl.float32)
                xq2 += tl.sum(q * x2[:, None], axis=0)
                xs2 += x2
                x3 = tl.load(xr3 + x_offs).to(tl.float32)
                xq3 += tl.sum(q * x3[:, None], axis=0)
                xs3 += x3
        acc0 += xq0 * scale + tl.sum(xs0, axis=0) * offset
        if BLOCK_M > 1:
            acc1 += xq1 * scale + tl.sum(xs1, axis=0) * offset
        if BLOCK_M > 2:
            acc2 += xq2 * scale + tl.sum(xs2, axis=0) * offset
            acc3 += xq3 * scale + tl.sum(xs3, axis=0) * offset

    tile = pid_m * tl.num_programs(0) + pid_n
    _epilogue(acc0, acc1, acc2, acc3, row0, pid_k, tile, part_ptr, count_ptr, bias_ptr, out_ptr,
              M, N, offs_n, num_splits, stride_om, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


# ------------------------------------------------------------------ W8A16 (e4m3 or int8 codes)

@triton.jit
def _w8a16_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, part_ptr, count_ptr, out_ptr,
    M, N, K, k_per_split, num_splits,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NATIVE_FP8: tl.constexpr = False, GROUP_K: tl.constexpr = 0, INT_CODES: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    row0 = pid_m * BLOCK_M
    xr0, xr1, xr2, xr3 = _row_pointers(x_ptr, row0, M, stride_xm)

    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_begin, k_end = gemm.split_k_range(pid_k, K, k_per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk
        x_offs = kk * stride_xk
        if EVEN_K:  # every K tile is whole (K % BLOCK_K == 0, and the slices are whole tiles)
            b = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
            x0 = tl.load(xr0 + x_offs).to(tl.float32)
            if BLOCK_M > 1:
                x1 = tl.load(xr1 + x_offs).to(tl.float32)
            if BLOCK_M > 2:
                x2 = tl.load(xr2 + x_offs).to(tl.float32)
                x3 = tl.load(xr3 + x_offs).to(tl.float32)
        else:  # the slice's last tile runs past its end: those columns weigh 0
            mask_k = kk < k_end
            b = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
            x0 = tl.load(xr0 + x_offs, mask=mask_k, other=0.0).to(tl.float32)
            if BLOCK_M > 1:
                x1 = tl.load(xr1 + x_offs, mask=mask_k, other=0.0).to(tl.float32)
            if BLOCK_M > 2:
                x2 = tl.load(xr2 + x_offs, mask=mask_k, other=0.0).to(tl.float32)
                x3 = tl.load(xr3 + x_offs, mask=mask_k, other=0.0).to(tl.float32)
        if INT_CODES:  # int8 c: the float 2^23 + (c + 128), less 2^23 + 128 (exact)
            wf = (b.to(tl.int32) + (MAGIC + 128)).to(tl.float32, bitcast=True) - (MAGIC_F + 128.0)
        elif NATIVE_FP8:  # e4m3 hardware (sm_89+): a conversion instruction, exact
            wf = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            wf = decode_e4m3(b)
        p0 = tl.sum(wf * x0[None, :], axis=1)
        if BLOCK_M > 1:
            p1 = tl.sum(wf * x1[None, :], axis=1)
        if BLOCK_M > 2:
            p2 = tl.sum(wf * x2[None, :], axis=1)
            p3 = tl.sum(wf * x3[None, :], axis=1)
        if GROUP_K > 0:  # the tile's sums, scaled by their group's scale (BLOCK_K divides GROUP_K)
            gs = tl.load(scale_ptr + offs_n * stride_sn + k0 // GROUP_K, mask=mask_n, other=0.0)
            acc0 += p0 * gs
            if BLOCK_M > 1:
                acc1 += p1 * gs
            if BLOCK_M > 2:
                acc2 += p2 * gs
                acc3 += p3 * gs
        else:
            acc0 += p0
            if BLOCK_M > 1:
                acc1 += p1
            if BLOCK_M > 2:
                acc2 += p2
                acc3 += p3

    if GROUP_K == 0:  # the channel scale, once (before the partials: each slice's sum is scaled alike)
        cs = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        acc0 = acc0 * cs
        acc1 = acc1 * cs
        acc2 = acc2 * cs
        acc3 = acc3 * cs
    tile = pid_m * tl.num_programs(0) + pid_n
    _epilogue(acc0, acc1, acc2, acc3, row0, pid_k, tile, part_ptr, count_ptr, bias_ptr, out_ptr,
              M, N, offs_n, num_splits, stride_om, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


# ------------------------------------------------------------------ host side

_COUNTERS: Dict[torch.device, torch.Tensor] = {}
_RETIRED: List[torch.Tensor] = []  # outgrown counter buffers: a captured CUDA graph may still use one
MIN_COUNTERS = 4096


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's split-K arrival counters (int32, all 0 between launches), at least `n`."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"GEMV split-K needs {n} counters on {device}, more than were allocated before this "
                           "CUDA graph capture: run the same shapes once uncaptured first (warm-up)")
    if buf is not None:
        _RETIRED.append(buf)
    size = max(n, MIN_COUNTERS, 2 * buf.numel() if buf is not None else 0)
    _COUNTERS[device] = buf = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def gemv_block_m(m: int) -> int:
    """BLOCK_M for m rows: 1, 2 or 4 (larger m is tiled over grid axis 2)."""
    return 1 if m <= 1 else 2 if m == 2 else 4


def _plan(cfg: GemmConfig, m: int, n: int, k: int, device: torch.device):
    """(grid, split, k_per_split, partials, counters) of one launch; partials [split, m, n] fp32
    and the counters only under split-K."""
    if cfg.block_m not in (1, 2, 4):
        raise ValueError(f"a GEMV config takes block_m 1, 2 or 4, got {cfg.block_m}")
    bk = cfg.block_k
    k_iters = triton.cdiv(k, bk)
    n_tiles, m_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    tiles = n_tiles * m_tiles
    split = cfg.split_k if cfg.split_k is not None else gemm.choose_split_k(tiles, k_iters, gemm.num_sms(device))
    split = max(1, min(split, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * bk
    split = triton.cdiv(k, k_per_split)  # no empty slice
    if split == 1:
        return (n_tiles, 1, m_tiles), 1, k_per_split, None, None
    part = torch.empty((split, m, n), dtype=torch.float32, device=device)
    return (n_tiles, split, m_tiles), split, k_per_split, part, _counters(device, tiles)


def w4a16_gemv(x2: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor], out: torch.Tensor,
               cfg: GemmConfig) -> torch.Tensor:
    """out [M, N] = x2 @ W^T (+ bias) for x2 [M, K] already in the weight's packed-row order
    (`Int4Weight.perm` applied, as `triton/int4.py`'s launcher does); returns out.

    cfg.block_k must be a power of two >= 8 dividing the group size (a K tile in one group)."""
    m, k = x2.shape
    n = w.out_features
    bk = cfg.block_k
    if bk < 8 or bk & (bk - 1) or w.group_size % bk or k % bk:
        raise ValueError(f"block_k={bk} must be a power of two >= 8 dividing group_size={w.group_size}")
    grid, split, k_per_split, part, counters = _plan(cfg, m, n, k, out.device)
    scales, offsets = w.scales.contiguous(), w.offsets.contiguous()  # no-ops for our own weights
    _w4a16_gemv_kernel[grid](
        x2, w.qweight, scales, offsets, bias if bias is not None else scales,
        part if part is not None else out, counters if counters is not None else out, out,
        m, n, k, w.group_size, k_per_split, split,
        x2.stride(0), x2.stride(1), w.qweight.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def w8a16_gemv(x2: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor], out: torch.Tensor,
               cfg: GemmConfig, native: Optional[bool] = None) -> torch.Tensor:
    """out [M, N] = x2 @ (w.weight * scale)^T (+ bias) for x2 [M, K] in bf16/fp16, an e4m3
    `Fp8Weight` or an `Int8Weight`, channel or group scales; returns out.

    native: decode e4m3 with the hardware conversion (default: `native_fp8` of the device; the
    launcher passes its own, which the AOT device model sets per target). With group scales
    cfg.block_k must divide the group."""
    m, k = x2.shape
    n = w.weight.shape[0]
    bk = cfg.block_k
    if bk < 16 or bk & (bk - 1) or (w.group_size and w.group_size % bk):
        raise ValueError(f"block_k={bk} must be a power of two >= 16"
                         + (f" dividing the group of {w.group_size} columns" if w.group_size else ""))
    int_codes = isinstance(w, Int8Weight)
    if native is None:
        native = native_fp8(x2.device)
    grid, split, k_per_split, part, counters = _plan(cfg, m, n, k, out.device)
    b = w.weight if int_codes else w.weight.view(torch.uint8)
    _w8a16_gemv_kernel[grid](
        x2, b, w.scale, bias if bias is not None else w.scale,
        part if part is not None else out, counters if counters is not None else out, out,
        m, n, k, k_per_split, split,
        x2.stride(0), x2.stride(1), b.stride(0), b.stride(1), w.scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split > 1, EVEN_K=k % bk == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        NATIVE_FP8=not int_codes and bool(native), GROUP_K=w.group_size, INT_CODES=int_codes,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = ["GEMV", "MAX_M", "gemv_block_m", "w4a16_gemv", "w8a16_gemv"]
