"""RMSNorm for CPU tensors in one C pass per row (kernels/cpu/rms_norm.c).

The model's RMSNorm is eight small torch ops; at 61 norms per step of a 30-layer model
their dispatch and memory passes were a noticeable part of a decode step and of a
128-token prefill (SmolLM2, bf16, 2 cores; benchmarks/RESULTS.md, "Figures behind design
choices in the code"); the residual add before each norm joins it (`add_rms_norm`). Built
at first use (kernels/cpu/native_build.py); `rms_norm` returns None where it does not apply and
the caller runs its torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import C_DTYPES, NativeLibrary


def _declare(library: ctypes.CDLL) -> None:
    p, i32 = ctypes.c_void_p, ctypes.c_int
    library.rms_norm.argtypes = [p, p, p, i32, i32, ctypes.c_float, i32, i32]
    library.rms_norm.restype = None
    library.add_rms_norm.argtypes = [p, p, p, p, p, i32, i32, ctypes.c_float, i32, i32]
    library.add_rms_norm.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("rms_norm.c"), "CPU RMSNorm", "torch ops", _declare)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, in transformers' rounding order;
    None unless x is a contiguous 2-D CPU float32/bfloat16 tensor with a weight of its dtype
    and the library is built."""
    library = _library_for(x, weight)
    if library is None:
        return None
    out = torch.empty_like(x)
    library.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, C_DTYPES[x.dtype],
                     torch.get_num_threads())
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h + delta, rms_norm(h + delta)), the sum rounded to the dtype first as transformers
    adds a residual; None where `rms_norm` would be, or delta is not h's shape and dtype."""
    library = _library_for(h, weight)
    if library is None or delta.shape != h.shape or delta.dtype != h.dtype or not delta.is_contiguous():
        return None
    total, out = torch.empty_like(h), torch.empty_like(h)
    library.add_rms_norm(h.data_ptr(), delta.data_ptr(), total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                         h.shape[0], h.shape[1], eps, C_DTYPES[h.dtype], torch.get_num_threads())
    return total, out


def _library_for(x: torch.Tensor, weight: torch.Tensor) -> ctypes.CDLL | None:
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in C_DTYPES or weight.dtype != x.dtype
            or not x.is_contiguous() or not weight.is_contiguous() or torch.compiler.is_compiling()):
        return None
    return LIBRARY.get()


__all__ = ["LIBRARY", "add_rms_norm", "rms_norm"]
