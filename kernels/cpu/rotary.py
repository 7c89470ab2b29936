"""Rotary position embedding for CPU tensors in one C pass (kernels/cpu/rotary.c).

In eager torch the rotation is seven small ops per layer; at 30 layers their dispatch and
allocations were a noticeable part of a decode step (SmolLM2, 2 cores;
benchmarks/RESULTS.md, "Figures behind design choices in the code"). Built at first use
(kernels/cpu/native_build.py); `rotary` returns None where it does not apply and the caller
runs its torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import C_DTYPES, NativeLibrary


def _declare(library: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    library.rotary.argtypes = [p, i64, p, p, p, i32, i32, i32, i32, i32]
    library.rotary.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("rotary.c"), "CPU rotary embedding", "torch ops", _declare)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin in transformers' rounding order, as a new contiguous
    tensor. x [tokens, heads, head_dim] may be a view whose tokens are rows of a wider
    tensor; cos/sin [tokens, 1, head_dim] in x's dtype. None unless the tensors are CPU
    float32/bfloat16 laid out so, and the library is built."""
    tokens, heads, head_dim = x.shape
    if (x.device.type != "cpu" or x.dtype not in C_DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype
            or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2 or torch.compiler.is_compiling()
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape != (tokens, 1, head_dim)
            or sin.shape != cos.shape):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    library.rotary(x.data_ptr(), x.stride(0), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads,
                   head_dim, C_DTYPES[x.dtype], torch.get_num_threads())
    return out


__all__ = ["LIBRARY", "rotary"]
