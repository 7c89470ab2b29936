"""FP8 (e4m3) weight GEMM in Triton, two paths sharing one kernel:

* "fp8"   (compute capability >= 8.9): activations are quantized per token to e4m3 by a
          small kernel, then `tl.dot` runs on fp8 x fp8 operands (FP8 tensor cores);
          the fp32 product is multiplied by x_scale[m] * w_scale[n] in the epilogue.
* "w8a16" (older GPUs): the weight is read as raw bytes and decoded from e4m3 bits to
          fp32 with integer ops (`triton/e4m3.py`'s `decode_e4m3`: exact; no fp8 type, which
          Triton rejects before sm89), or converted by the hardware where it has e4m3,
          cast to the activation dtype and multiplied on 16-bit tensor cores; w_scale[n]
          is applied in the epilogue. On e4m3 hardware it is also a candidate of "fp8"
          mode for decode-sized M (`GemmConfig.variant`): no per-token quantization
          kernel before it.

int8 weights (`Int8Weight`: W8A16 checkpoints) take the "w8a16" path with INT_CODES set: the
codes convert to float exactly, the scales are applied as for e4m3.

Weights with group scales (block-wise checkpoints, `Fp8Weight.group_size`) run the same
kernel with GROUP_K set: each K tile's product is scaled by its group's scale per column
before it joins the fp32 accumulator (the channel form scales once, in the epilogue); the
activations stay quantized per token.

At M <= 4, in either mode and for int8 codes, the first candidates are `triton/gemv.py`'s W8A16
GEMV (variant "gemv": the weight decoded in registers against the 16-bit activations, FMAs, no
tensor cores and no per-token quantization; split-K reduced in the same launch), the untimed
default there.

Launch scaffolding (split-K with a deterministic reduction for small M, timed config
choice, tile order) is shared with the INT4 kernel in `triton/gemm.py`. In "fp8" mode on a
GPU, cuBLASLt's row-wise-scaled FP8 GEMM (`torch._scaled_mm`, the same product of the same
quantized operands) is one more candidate of the timed choice (`SCALED_MM`): per shape and
M bucket the faster of it and our tiles runs.

Under TRITON_INTERPRET=1 both paths run (the interpreter keeps fp8 as uint8 and decodes
it for `tl.dot`); the default there is "fp8" (what an H100 runs), PAGEDSERVE_FP8_MODE
overrides it, except on a CUDA device without e4m3 hardware (< sm89), where only "w8a16"
compiles and is always the default (an explicit mode="fp8" raises there). The activation
quantizer encodes e4m3 bits with integer ops (`triton/e4m3.py`'s `e4m3_bits`, round to nearest
even) and stores them through a uint8 view, so its result equals
`fp8.quantize_per_token_fp8` bit for bit on every backend (the interpreter's own
fp32->fp8 rounding is not round-to-nearest-even) and it compiles for every GPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..fp8 import Fp8Weight, Int8Weight
from ..numerics import AMAX_EPS, FP8_DTYPE, FP8_MAX
from .e4m3 import decode_e4m3, e4m3_bits, native_fp8
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
from .gemv import GEMV, MAX_M, gemv_block_m, w8a16_gemv


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                            FP8_MAX_C: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), EPS), FP8_MAX_C)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * stride_qm + k0 + offs, e4m3_bits(v), mask=mask)  # q_ptr: uint8


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_os, stride_sn,
    A_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NATIVE_FP8: tl.constexpr = False, GROUP_K: tl.constexpr = 0, INT_CODES: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin, k_end = split_k_range(pid_k, K, k_per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < k_end
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # B tile [BLOCK_K, BLOCK_N] read from the [N, K] weight (K-major operand).
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        if GROUP_K > 0:  # the tile's product, then its group's scale per column
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            part = acc
        if A_FP8:
            # Hopper's FP8 tensor cores sum with reduced precision; a fresh partial sum
            # per K tile, added to acc in float32, keeps the error within fp16's
            part = tl.dot(a, b, part, max_num_imprecise_acc=BLOCK_K)
        else:
            if INT_CODES:  # int8 weights (Int8Weight)
                bf = b.to(tl.float32)
            elif NATIVE_FP8:  # e4m3 hardware (sm_89+): a conversion instruction, exact
                bf = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                bf = decode_e4m3(b)
            if DOT_F32:
                part = tl.dot(a.to(tl.float32), bf, part, input_precision="ieee")
            else:
                part = tl.dot(a, bf.to(a.dtype), part)  # e4m3 values are exact in 16 bits
        if GROUP_K > 0:  # a K tile lies inside one group (BLOCK_K divides GROUP_K)
            group_scale = tl.load(b_scale_ptr + offs_n * stride_sn + k0 // GROUP_K, mask=mask_n, other=0.0)
            acc += part * group_scale[None, :]
        else:
            acc = part

    if A_FP8:
        acc = acc * tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if GROUP_K == 0:
        acc = acc * tl.load(b_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    store_tile(acc, out_ptr, bias_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, stride_om, stride_os,
               HAS_BIAS, SPLIT)


# ------------------------------------------------------------------ host side

def default_mode(device: torch.device) -> str:
    """The mode for `device`: "w8a16" without e4m3 hardware (CUDA < sm89, where "fp8" would
    not compile, whatever PAGEDSERVE_FP8_MODE says), else PAGEDSERVE_FP8_MODE if set, else
    "fp8"."""
    if not native_fp8(device):
        return "w8a16"
    env = os.environ.get("PAGEDSERVE_FP8_MODE")
    if env in ("fp8", "w8a16"):
        return env
    return "fp8"


def per_token_quant_fp8_triton(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `fp8.quantize_per_token_fp8` for x [M, K] (bit-identical)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, max(16, triton.next_power_of_2(k)))
        _per_token_quant_kernel[(m,)](x, q.view(torch.uint8), s, k, x.stride(0), q.stride(0),
                                      FP8_MAX_C=FP8_MAX, EPS=AMAX_EPS, BLOCK=block, num_warps=4)
    return q, s


GEMV_TILES = {
    1: [(128, 128, 8), (64, 64, 4), (64, 128, 8), (256, 128, 16)],
    2: [(128, 128, 8), (64, 64, 4), (64, 128, 8), (256, 128, 16)],
    4: [(64, 128, 8), (64, 64, 4), (256, 128, 16), (128, 128, 8)],  # (128, 128, 8): up to 173 registers here
}
"""BLOCK_M -> (BLOCK_N, BLOCK_K, warps) of the GEMV candidates at M <= 4 (`triton/gemv.py`), the
first the untimed default: BLOCK_N and BLOCK_K below the thread count (no layout conversion in
the loop), 32 or 64 weight bytes a thread a K tile. Group scales cap BLOCK_K (`_candidates`); the
split is `choose_split_k`'s (~2 programs per SM)."""


def _candidates(m: int, n: int, k: int, mode: str, group: int = 0):
    """The tiles tried for one shape; with group scales (`group` > 0) each K tile must lie
    inside one group, so BLOCK_K is capped at the largest power of two dividing it."""
    configs = _tiles(m, n, k, mode)
    if not group:
        return configs
    cap = group & -group
    grouped = [dataclasses.replace(c, block_k=min(c.block_k, cap)) for c in configs]
    return [c for i, c in enumerate(grouped) if c not in grouped[:i]]


def _tiles(m: int, n: int, k: int, mode: str):
    if interpreting():
        bm, bn = interpreter_tile(m, n)
        bk = max(32, min(128, triton.next_power_of_2(k)))
        return [GemmConfig(bm, bn, bk, split_k=1)]
    if m <= 16:
        # split-K (the heuristic's) for few output tiles, and whole-K tiles narrow enough to
        # give every SM one: a decode step is a chain of small GEMMs bound by reading the weight
        raw = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 64, 4, 4)]
        whole_k = [GemmConfig(16, 32, 256, 4, 4, split_k=1), GemmConfig(16, 64, 256, 4, 4, split_k=1)]
        configs = [GemmConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in raw] + whole_k
        if mode == "fp8":  # also without the per-token quantization (one kernel less per linear)
            configs += [dataclasses.replace(c, variant="w8a16") for c in configs[:2] + whole_k]
        if m <= MAX_M:  # decode-sized: the GEMV kernel first (16-bit activations in either mode)
            bm = gemv_block_m(m)
            configs = [GemmConfig(bm, bn, bk, w, 2, variant=GEMV) for bn, bk, w in GEMV_TILES[bm]] + configs
        return configs
    elif m <= 64:
        raw = [(64, 64, 128, 4, 4), (32, 128, 128, 4, 4), (64, 128, 128, 4, 3)]
    elif mode == "fp8":
        raw = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4), (128, 128, 64, 4, 4)]
    else:
        raw = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4)]
    return [GemmConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in raw]


SCALED_MM = GemmConfig(0, 0, 0)
"""The candidate that runs torch._scaled_mm (cuBLASLt, row-wise scales) instead of our kernel."""


def _scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, w: Fp8Weight, bias, out: torch.Tensor) -> torch.Tensor:
    y = torch._scaled_mm(a, w.weight.t(), scale_a=a_scale.view(-1, 1), scale_b=w.scale.view(1, -1), out_dtype=out.dtype)
    return y if bias is None else y.add_(bias.to(y.dtype))


def quantizes(cfg: GemmConfig, mode: str) -> bool:
    """Whether a launch of `cfg` in `mode` takes per-token e4m3 activations (not the W8A16
    launches: variant "w8a16" and the GEMV)."""
    return mode == "fp8" and cfg.variant not in ("w8a16", GEMV)


def _run(x2: torch.Tensor, w: Fp8Weight, bias, out: torch.Tensor, cfg: GemmConfig, mode: str) -> torch.Tensor:
    """Quantize the activations where `cfg` takes them in e4m3, then the product."""
    if quantizes(cfg, mode):
        a, a_scale = per_token_quant_fp8_triton(x2)
        return _launch(a, a_scale, w, bias, out, cfg, True)
    return _launch(x2, None, w, bias, out, cfg, False)


def _launch(a, a_scale, w: Fp8Weight, bias, out, cfg: GemmConfig, a_fp8: bool) -> torch.Tensor:
    """The product into `out` (our kernel) or a new tensor (SCALED_MM); returns it."""
    if cfg is SCALED_MM:
        return _scaled_mm(a, a_scale, w, bias, out)
    if cfg.variant == GEMV:
        if a_fp8:
            raise ValueError("the GEMV takes 16-bit activations (quantizes() is False for it)")
        return w8a16_gemv(a, w, bias, out, cfg, native=native_fp8(a.device))
    m, k = a.shape
    n = w.weight.shape[0]
    tiles, split, k_per_split, dst = plan_split(cfg, m, n, k, out)
    int_codes = isinstance(w, Int8Weight)
    b = w.weight if a_fp8 or int_codes else w.weight.view(torch.uint8)
    _fp8_gemm_kernel[(tiles, split)](
        a, b, a_scale if a_fp8 else w.scale, w.scale, bias if bias is not None else w.scale, dst,
        m, n, k, k_per_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), n, m * n, w.scale.stride(0),
        A_FP8=a_fp8, HAS_BIAS=bias is not None, SPLIT=split > 1, DOT_F32=interpreting(),
        NATIVE_FP8=not a_fp8 and not int_codes and native_fp8(a.device), GROUP_K=w.group_size, INT_CODES=int_codes,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        launch_splitk_reduce(dst, bias, out)
    return out


def fp8_matmul_triton(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None, *,
                      mode: Optional[str] = None, config: Optional[GemmConfig] = None) -> torch.Tensor:
    """y = x @ (w.weight * w.scale)^T (+ bias) for bf16/fp16 x [..., K]; returns x.dtype.
    Channel or group scales (`Fp8Weight.group_size`) alike; an Int8Weight runs in "w8a16" mode.

    mode: "fp8" (per-token e4m3 activations, FP8 tensor cores) or "w8a16"; default by
    device capability (see module doc).
    """
    n, k = w.shape
    check_activations(x, k, "fp8_matmul_triton")
    mode = mode or ("w8a16" if isinstance(w, Int8Weight) else default_mode(x.device))
    if mode not in ("fp8", "w8a16"):
        raise ValueError(f"mode must be 'fp8' or 'w8a16', got {mode!r}")
    if mode == "fp8" and isinstance(w, Int8Weight):
        raise ValueError("int8 weights run in mode 'w8a16' (16-bit activations as they are)")
    if mode == "fp8" and not native_fp8(x.device):
        raise ValueError("mode 'fp8' needs FP8 tensor cores (compute capability >= 8.9); use 'w8a16'")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    if config is not None and w.group_size and (config is SCALED_MM or w.group_size % config.block_k):
        raise ValueError(f"a weight with group scales of {w.group_size} columns needs our kernel with a BLOCK_K "
                         f"dividing {w.group_size}, got {config}")
    if config is None:
        key = ("fp8", x.device, bucket_m(m), n, k, x.dtype, mode, bias is not None, w.group_size, w.CODES)
        candidates = _candidates(m, n, k, mode, w.group_size)
        if mode == "fp8" and x.is_cuda and hasattr(torch, "_scaled_mm") and not w.group_size:
            candidates.append(SCALED_MM)
        config = timed_choice(key, candidates, lambda c: _run(x2, w, bias, out, c, mode))
    return _run(x2, w, bias, out, config, mode).view(*lead, n)
