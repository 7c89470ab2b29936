"""float32 matrix-vector products for CPU in C (kernels/cpu/gemv.c): a decoding sequence's
matmuls, bound by how fast the weights stream from memory.

`gemv` multiplies a few rows (up to GEMV_MAX_ROWS) by a float32 weight as the checkpoint stores
it, [out, in]: backend/cpu/linear_methods.py sends the small steps of weights laid out "both" here
(backend/cpu/matmul_probe.py). A weight that is exactly a GGUF Q4_1 / Q8_0 one goes to
kernels/cpu/block_matmul.py instead. Built at first use (kernels/cpu/native_build.py); returns None
where it does not apply, and the caller runs torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import NativeLibrary

GEMV_MAX_ROWS = 4
"""Rows per call the C loop takes: it streams the weight once per call, and each further row
adds dot products. Against oneDNN's packed float32 over 30 layers of SmolLM2's weights (2-core
AVX2 EPYC) the C loop is faster at one, two and four rows; beyond a few rows oneDNN's blocked
kernel wins (benchmarks/RESULTS.md, "Figures behind design choices in the code")."""


def _declare(library: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    library.gemv_f32.argtypes = [p, p, p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.gemv_f32.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("gemv.c"), "CPU float32 GEMV", "torch's matmul", _declare)


def operands_fit(x: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
                 max_rows: int) -> bool:
    """Whether the C loops take these operands: x a contiguous 2-D CPU float32 tensor of 1 to
    max_rows rows and in_features columns, bias None or float32 [out_features], outside compilation."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32 and 0 < x.shape[0] <= max_rows
            and x.shape[1] == in_features and x.is_contiguous() and not torch.compiler.is_compiling()
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (out_features,) and bias.is_contiguous())))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias), [rows, out]; None unless the operands fit (`operands_fit`, up to
    GEMV_MAX_ROWS rows), weight is a contiguous 2-D float32 tensor and the library is built."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    if not operands_fit(x, weight.shape[0], weight.shape[1], bias, GEMV_MAX_ROWS):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = x.new_empty((x.shape[0], weight.shape[0]))
    library.gemv_f32(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                     x.shape[0], weight.shape[1], weight.shape[0], torch.get_num_threads())
    return out


__all__ = ["GEMV_MAX_ROWS", "LIBRARY", "gemv", "operands_fit"]
