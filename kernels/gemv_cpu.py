"""float32 matrix-vector products for CPU in C (kernels/gemv_cpu.c): a decoding sequence's
matmuls, bound by how fast the weights stream from memory.

`gemv` multiplies up to GEMV_MAX_ROWS rows by a weight laid out as the checkpoint stores
it, [out, in]; backend/models/linear.py sends a step of that few rows here where a layer
keeps that weight (the "both" layout, backend/matmul_probe.py). Built at first use
(kernels/native_build.py); returns None where it does not apply, and the caller runs torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import NativeLibrary

GEMV_MAX_ROWS = 4
"""Rows per call the C loop takes: it streams the weight once per call, and each further row
adds dot products. Against oneDNN's packed float32 over 30 layers of SmolLM2's weights (2-core
AVX2 EPYC): 18.2 vs 21.5 ms at one row, 19.7 vs 21.7 at two, 23.1 vs 25.1 at four; beyond a
few rows oneDNN's blocked kernel wins."""


def _declare(library: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    library.gemv_f32.argtypes = [p, p, p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.gemv_f32.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("gemv_cpu.c"), "CPU float32 GEMV", "torch's matmul", _declare)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias), [rows, out]; None unless x is a contiguous 2-D CPU float32 tensor of
    at most GEMV_MAX_ROWS rows, weight (and bias) contiguous float32 of matching size, and the
    library is built."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.float32 or not 0 < x.shape[0] <= GEMV_MAX_ROWS
            or weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] != x.shape[1]
            or not x.is_contiguous() or not weight.is_contiguous() or torch.compiler.is_compiling()):
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != weight.shape[:1] or not bias.is_contiguous()):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = x.new_empty((x.shape[0], weight.shape[0]))
    library.gemv_f32(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                     x.shape[0], x.shape[1], weight.shape[0], torch.get_num_threads())
    return out


__all__ = ["GEMV_MAX_ROWS", "LIBRARY", "gemv"]
