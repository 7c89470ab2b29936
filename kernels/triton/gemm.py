"""GEMM scaffolding shared by the quantized-weight Triton kernels (`triton/int4.py`,
`triton/fp8.py`), so that neither kernel module is the other's library.

In-kernel (`@triton.jit` helpers, inlined by the compiler):
  * `grouped_tile`: the program's output tile in grouped order (GROUP_M row-tiles
    share each weight column-tile while it is in L2), with its offsets and masks;
  * `split_k_range`: the K-slice of this program (grid axis 1);
  * `store_tile`: the epilogue, an fp32 partial per K-slice under split-K, else
    bias + cast to the output dtype.

Split-K: decode-sized M (and any launch with fewer output tiles than SMs) gives each
program a slice of K and writes an fp32 partial; `_splitk_reduce_kernel` sums the
partials in a fixed order, adds the bias and casts (deterministic, unlike atomics).

Configs: the choice committed for this GPU where `configs/` has its file (`tuned.py`, written
by benchmarks/tune_kernels.py), else a handful per regime, timed once per key (device, M bucket,
shape, dtype...) and cached, in the process and on disk (`gemm_choices/` of the cache directory, per GPU
name and Triton version), so a restarted server does not time them again
(`PAGEDSERVE_AUTOTUNE=0` turns timing off and takes the first candidate). Under
TRITON_INTERPRET=1 the first candidate is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..numerics import cdiv

# ------------------------------------------------------------------ in-kernel helpers

@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """offs_m, offs_n, mask_m, mask_n of output tile `pid` (program_id(0)), grouped order."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def split_k_range(pid_k, K, k_per_split):
    """[k_begin, k_end) of K-slice `pid_k` (program_id(1))."""
    k_begin = pid_k * k_per_split
    return k_begin, tl.minimum(k_begin + k_per_split, K)


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, stride_om, stride_os,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Epilogue: under SPLIT the fp32 partial of K-slice `pid_k` (bias and cast are
    left to the reduction), else acc (+ bias) cast to the output dtype."""
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
    variant: str = ""
    """A kernel's own variant of the launch (fp8: "w8a16", the fp8 weight against the 16-bit
    activations as they are, where the default quantizes them per token first)."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_activations(x: torch.Tensor, k: int, fn: str) -> None:
    """x [..., k] in bf16/fp16, on CUDA unless interpreting; `fn` names the caller in errors."""
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{fn} takes bf16/fp16 activations, got {x.dtype}")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 for CPU)")


def interpreter_tile(m: int, n: int) -> Tuple[int, int]:
    """(block_m, block_n) under the interpreter: few, large programs, as the numpy
    interpreter pays per program, not per element."""
    return (16 if m <= 16 else 32), max(16, min(64, triton.next_power_of_2(n)))


def choose_split_k(tiles: int, k_iters: int, sms: int) -> int:
    """Enough K-slices to give ~2 programs per SM when the output has few tiles."""
    if tiles >= sms or k_iters <= 1:
        return 1
    split = min(k_iters, cdiv(2 * sms, tiles), 32)
    return cdiv(k_iters, cdiv(k_iters, split))  # drop empty slices


def plan_split(cfg: GemmConfig, m: int, n: int, k: int,
               out: torch.Tensor) -> Tuple[int, int, int, torch.Tensor]:
    """(tiles, split, k_per_split, dst) for a launch on grid (tiles, split): dst is `out`
    itself without split-K, else a fresh [split, m, n] fp32 buffer of partials."""
    bk = cfg.block_k
    k_iters = triton.cdiv(k, bk)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k if cfg.split_k is not None else choose_split_k(tiles, k_iters, num_sms(out.device))
    split = max(1, min(split, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * bk
    split = triton.cdiv(k, k_per_split)
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    return tiles, split, k_per_split, dst


def launch_splitk_reduce(part: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    split, m, n = part.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else part, out, m * n, n,
        SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def bucket_m(m: int) -> int:
    """M rounded up to a power of two: configs are timed once per bucket."""
    return 1 << max(0, (m - 1).bit_length())


_TUNED: Dict[Tuple, GemmConfig] = {}


def _choices_file(device: torch.device) -> str:
    """The disk cache of timed choices for this GPU model and Triton version."""
    from ..cache_dir import cache_root

    name = torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")
    return str(cache_root() / "gemm_choices" / f"{name}-triton{triton.__version__}.json")


def _stored_choice(key: Tuple, candidates: List[GemmConfig]) -> Optional[GemmConfig]:
    """A choice timed by an earlier process on the same kind of GPU, if it is a candidate still."""
    device = next((part for part in key if isinstance(part, torch.device)), None)
    if device is None or device.type != "cuda":
        return None
    import json

    try:
        with open(_choices_file(device)) as f:
            stored = json.load(f).get(repr(key))
    except (OSError, ValueError):
        return None
    return next((c for c in candidates if stored is not None and repr(c) == stored), None)


def _store_choice(key: Tuple, choice: GemmConfig) -> None:
    device = next((part for part in key if isinstance(part, torch.device)), None)
    if device is None or device.type != "cuda":
        return
    import json

    path = _choices_file(device)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                stored = json.load(f)
        except (OSError, ValueError):
            stored = {}
        stored[repr(key)] = repr(choice)
        partial = f"{path}.tmp{os.getpid()}"
        with open(partial, "w") as f:
            json.dump(stored, f, indent=0)
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache only costs the timing next time


def timed_choice(key: Tuple, candidates: List[GemmConfig],
                 run: Callable[[GemmConfig], object]) -> GemmConfig:
    """Pick the fastest candidate once per key (the small 'autotune' of this package);
    keys start with the kernel's name, so kernels share the cache without colliding. A choice
    committed for this GPU (`triton/tuned.py`) comes first and is never timed."""
    if key in _TUNED:
        return _TUNED[key]
    from .tuned import committed_choice

    committed = committed_choice(key, candidates)
    if committed is not None:
        _TUNED[key] = committed
        return committed
    stored = _stored_choice(key, candidates)
    if stored is not None:
        _TUNED[key] = stored
        return stored
    if (len(candidates) == 1 or interpreting() or os.environ.get("PAGEDSERVE_AUTOTUNE", "1") == "0"
            or torch.cuda.is_current_stream_capturing()):
        return candidates[0]
    from triton.testing import do_bench

    best, best_t = candidates[0], float("inf")
    for cand in candidates:
        try:
            t = do_bench(lambda: run(cand), warmup=5, rep=20)  # noqa: B023 - called in this iteration only
        except Exception:  # noqa: BLE001 - a candidate that fails to run (e.g. out of shared memory on a smaller GPU)
            continue
        if t < best_t:
            best, best_t = cand, t
    _TUNED[key] = best
    _store_choice(key, best)
    return best
