"""RMSNorm for CPU tensors in one C pass per row (kernels/rms_norm_cpu.c).

The model's RMSNorm is eight small torch ops; at 61 norms per step of a 30-layer model
their dispatch and memory passes were ~1-4 ms of a 24-50 ms decode step and ~6 ms of a
128-token prefill (SmolLM2, bf16, 2 cores). Built at first use (kernels/native_build.py);
`rms_norm` returns None where it does not apply and the caller runs its torch ops.
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


LIBRARY = NativeLibrary(Path(__file__).with_name("rms_norm_cpu.c"), "CPU RMSNorm", "torch ops", _declare)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, in transformers' rounding order;
    None unless x is a contiguous 2-D CPU float32/bfloat16 tensor with a weight of its dtype
    and the library is built."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in C_DTYPES or weight.dtype != x.dtype
            or not x.is_contiguous() or not weight.is_contiguous() or torch.compiler.is_compiling()):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = torch.empty_like(x)
    library.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, C_DTYPES[x.dtype],
                     torch.get_num_threads())
    return out


__all__ = ["LIBRARY", "rms_norm"]
