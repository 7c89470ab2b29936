"""The one place the model code's kernels are picked: Triton, C (CPU) or the torch references.

Callers get plain functions: the engine's attention layer asks `attention_kernels`
once, the quantized linears call `int4_linear` / `fp8_linear` per step, an adapted layer `add_lora`, the model's norms,
rotary embedding and activation ask the `fused_*` functions, the sampler `first_max_index`.
Attention has a third implementation beside the Triton kernel and the reference: the CPU
attention (kernels/cpu/paged_attention.py), what `auto` runs on CPU. The fused CPU ops return
None off CPU, while compiling, or where their C kernel declines: the caller then runs its
torch ops. Each family is imported only inside its branch: the GPU path loads nothing of
kernels/cpu/, and the torch path never needs triton installed (a missing triton surfaces as
ImportError from the Triton branch). The other user of kernels/cpu/ is the CPU backend
(backend/cpu/), whose weight layouts are the C kernels' own.
PAGEDSERVE_FORCE_TRITON=1 sends CPU tensors of the linears to the Triton kernels
too, which only works together with TRITON_INTERPRET=1 (set before triton is first
imported); that is how the kernels are exercised on machines without a GPU.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable, Optional

import torch

from .cache_write import write_kv_cache_ref
from .fp8 import Fp8Weight, fp8_matmul_ref
from .int4 import Int4Weight, w4a16_matmul_ref
from .lora import SlotRows, add_lora_ref
from .moe import ExpertWeights, fused_moe_ref
from .paged_attention import paged_attention_ref

FORCE_ENV = "PAGEDSERVE_FORCE_TRITON"

WriteCacheFn = Callable[..., None]
AttendFn = Callable[..., torch.Tensor]


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a linear on this tensor runs the Triton kernel: on CUDA, or anywhere
    when PAGEDSERVE_FORCE_TRITON=1; and only for 16-bit activations, the only ones the
    Triton GEMMs take (a float32 engine's quantized linears run the reference)."""
    return triton_wanted(tensor.device) and tensor.dtype in (torch.bfloat16, torch.float16)


def triton_wanted(device: torch.device) -> bool:
    """Whether an engine on `device` runs the Triton kernels: on CUDA, or anywhere when
    PAGEDSERVE_FORCE_TRITON=1 (with TRITON_INTERPRET=1 on CPU, as tests do)."""
    return device.type == "cuda" or os.environ.get(FORCE_ENV, "0") == "1"


def attention_kernels(name: str, device: torch.device, batch_invariant: bool = False) -> tuple[WriteCacheFn, AttendFn]:
    """(write_cache, attend) for an `attention_backend` setting: "torch" the references,
    "cpu" the CPU attention with the reference cache write (ValueError off CPU), "auto"
    the Triton kernels on CUDA and the CPU attention on CPU, anything else the Triton
    kernels (ImportError when triton or what they need is missing). batch_invariant
    (`deterministic`): the CPU attention's batch-invariant form on CPU, the Triton kernels'
    batch-invariant launch on a GPU (ValueError where the setting names another attention)."""
    if batch_invariant and device.type == "cpu" and not triton_wanted(device):
        if name not in ("auto", "cpu"):
            raise ValueError(f"deterministic runs the CPU attention's batch-invariant form, not {name!r}")
        from .cpu.cache_write import write_kv_cache_cpu
        from .cpu.paged_attention import paged_attention_cpu_batch_invariant

        return write_kv_cache_cpu, paged_attention_cpu_batch_invariant
    if batch_invariant:
        if name not in ("auto", "triton"):
            raise ValueError(f"deterministic runs the Triton attention's batch-invariant launch, not {name!r} on {device.type}")
        from .triton.cache_write import write_kv_cache_triton
        from .triton.paged_attention import paged_attention_triton

        return write_kv_cache_triton, functools.partial(paged_attention_triton, batch_invariant=True)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"the CPU attention runs on CPU tensors only, not {device.type}")
        from .cpu.cache_write import write_kv_cache_cpu
        from .cpu.paged_attention import paged_attention_cpu

        return write_kv_cache_cpu, paged_attention_cpu
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return write_kv_cache_ref, paged_attention_ref
    from .triton.cache_write import write_kv_cache_triton
    from .triton.paged_attention import paged_attention_triton

    return write_kv_cache_triton, paged_attention_triton


def read_tuned_configs(device: torch.device) -> int:
    """Read this GPU's committed kernel choices once, at model load (kernels/triton/tuned.py: no
    timing on the request path where the file has the shape); how many it holds, 0 off CUDA or
    without a file (the launchers' heuristics then)."""
    if device.type != "cuda":
        return 0
    from .triton.tuned import for_device

    return len(for_device(device).entries)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with a packed INT4 weight; returns x.dtype [..., N]."""
    if use_triton(x):
        from .triton.int4 import w4a16_matmul_triton

        return w4a16_matmul_triton(x, w, bias)
    return w4a16_matmul_ref(x, w, bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ (weight * scale)^T (+ bias) with an e4m3 (or int8: Int8Weight) weight; returns
    x.dtype [..., N].

    On GPUs with compute capability >= 8.9 the activations are quantized per token to
    e4m3 (FP8 tensor cores); elsewhere, and for int8 codes, the weight is upconverted (W8A16,
    as the reference).
    """
    if use_triton(x):
        from .triton.fp8 import fp8_matmul_triton

        return fp8_matmul_triton(x, w, bias)
    return fp8_matmul_ref(x, w, bias)


def fused_moe(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              batch_invariant: bool = False) -> torch.Tensor:
    """The mixture-of-experts MLP of a flat batch (layout: kernels/moe.py): the fused Triton kernel where
    `use_triton` (16-bit activations on CUDA; batch_invariant: its launch whose tiles do not depend on
    the batch), else the torch reference (one pair of matmuls per expert with tokens: the CPU path)."""
    if use_triton(x):
        from .triton.moe import fused_moe_triton

        return fused_moe_triton(x, experts, topk_weights, topk_ids, batch_invariant=batch_invariant)
    return fused_moe_ref(x, experts, topk_weights, topk_ids)


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
             token_slots: torch.Tensor, groups: list[SlotRows] | None = None) -> torch.Tensor:
    """out += each token's LoRA delta (layout: kernels/lora.py): the grouped Triton kernels where
    `use_triton` (16-bit activations on CUDA), else the torch reference (two matmuls per adapter in
    the step: the CPU path, which takes the step's `groups` where the caller has them)."""
    if use_triton(x):
        from .triton.lora import add_lora_triton

        return add_lora_triton(out, x, a, b, scaling, token_slots)
    return add_lora_ref(out, x, a, b, scaling, token_slots, groups)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every row is summed in one order whatever the row count (kernels/triton/
    batch_invariant.py): `deterministic` on a GPU, where cuBLAS picks its algorithm by the rows."""
    from .triton.batch_invariant import matmul

    return matmul(x, weight, bias)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rounds_once: bool,
                       offset: float) -> torch.Tensor:
    """The model's RMSNorm (its rounding order) one row a program: `deterministic` on a GPU."""
    from .triton.batch_invariant import rms_norm

    return rms_norm(x, weight, eps, rounds_once, offset)


def invariant_log_softmax(rows: torch.Tensor) -> torch.Tensor:
    """log_softmax of float32 rows [R, V], one row a program: `deterministic` on a GPU."""
    from .triton.batch_invariant import log_softmax

    return log_softmax(rows)


@functools.cache
def _cpu_kernel(module: str, name: str) -> Callable[..., Any]:
    """kernels/cpu/<module>.py's `name`, imported on first use (a GPU process never does)."""
    return getattr(importlib.import_module(f"{__package__}.cpu.{module}"), name)


def _on_cpu_eagerly(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm (transformers' rounding order) in one C pass a row on CPU; None: use torch."""
    return _cpu_kernel("rms_norm", "rms_norm")(x, weight, eps) if _on_cpu_eagerly(x) else None


def fused_add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h + delta, its RMSNorm) in one C pass on CPU; None: use torch."""
    return _cpu_kernel("rms_norm", "add_rms_norm")(h, delta, weight, eps) if _on_cpu_eagerly(h) else None


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin in one C pass on CPU; None: use torch."""
    return _cpu_kernel("rotary", "rotary")(x, cos, sin) if _on_cpu_eagerly(x) else None


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of [rows, 2 * n] in one C pass on CPU; None: use torch."""
    return _cpu_kernel("silu_mul", "silu_mul")(gate_up) if _on_cpu_eagerly(gate_up) else None


def first_max_index(rows: torch.Tensor) -> torch.Tensor | None:
    """Each row's first maximum (argmax's answer, NaN as largest) in one C pass on CPU; None: use torch."""
    return _cpu_kernel("first_max", "first_max_index")(rows) if _on_cpu_eagerly(rows) else None


def build_cpu_kernels(report: Callable[[str], None] | None = None) -> dict[str, bool]:
    """Compile every C kernel for this CPU now, or find it built ({kernel: built}; `report` gets a
    line each): `pagedserve build-kernels` at install and a CPU engine at load, so that no
    request pays a compile."""
    return _cpu_kernel("native_build", "build_all")(report)


__all__ = ["FORCE_ENV", "attention_kernels", "build_cpu_kernels", "first_max_index", "fp8_linear",
           "fused_add_rms_norm", "fused_moe", "fused_rms_norm", "fused_rotary", "fused_silu_mul", "int4_linear",
           "invariant_linear", "invariant_log_softmax", "invariant_rms_norm", "triton_wanted", "use_triton"]
