"""float32 matrix-vector products for CPU in C (kernels/gemv_cpu.c): a decoding sequence's
matmuls, bound by how fast the weights stream from memory.

`gemv` multiplies up to GEMV_MAX_ROWS rows by a weight laid out as the checkpoint stores
it, [out, in]; backend/models/linear.py sends a step of that few rows here where a layer
keeps that weight (the "both" layout, backend/matmul_probe.py). Built at first use
(kernels/native_build.py); returns None where it does not apply, and the caller runs torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
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
    library.gemv_q4_f32.argtypes = [p, p, p, p, p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.gemv_q4_f32.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("gemv_cpu.c"), "CPU float32 GEMV", "torch's matmul", _declare)


Q4_MAX_ROWS = 8
"""Rows per call for a Q4Weight (gemv_cpu.c's Q4_MAX_ROWS): it reads a sixth of the bytes,
so its dot products stay cheaper than oneDNN's float32 kernel over more rows."""
Q4_BLOCK = 32
"""Inputs per Q4_1 block (one scale and one offset each)."""


@dataclass(frozen=True)
class Q4Weight:
    """A float32 weight [out, in] each of whose blocks of 32 inputs is d * q + m, q in 0..15
    and d, m values of fp16: what a GGUF Q4_1 checkpoint dequantizes to (the bundled model's
    decoder layers). Kept as those parts it is the same weight, bit for bit, in 0.75 bytes a
    value instead of 4, and a single stream's decode streams a sixth of the bytes."""

    nibbles: torch.Tensor
    """uint8 [out, in / 2]: byte j of a block holds input j (low nibble) and j + 16 (high)."""
    scales: torch.Tensor
    """float32 [out, in / 32]: d of each block."""
    offsets: torch.Tensor
    """float32 [out, in / 32]: m of each block."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * Q4_BLOCK


def as_q4(weight: torch.Tensor) -> Q4Weight | None:
    """The weight as Q4_1 parts, or None unless every value is rebuilt exactly from them
    (checked here, so a weight that merely looks quantized is never approximated)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % Q4_BLOCK or weight.numel() == 0:
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, Q4_BLOCK)
    low = blocks.amin(-1)  # the block's offset m: its smallest value has q = 0
    scale = ((blocks.amax(-1) - low) / 15).half().float()  # its largest has q = 15
    if not torch.equal(low.half().float(), low) or not bool(torch.isfinite(scale).all()):
        return None
    step = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = torch.round((blocks - low[..., None]) / step)
    q = torch.where(scale[..., None] > 0, q, torch.zeros_like(q))
    if bool((q < 0).any()) or bool((q > 15).any()) or not torch.equal(scale[..., None] * q + low[..., None], blocks):
        return None
    q = q.to(torch.uint8)
    nibbles = q[..., : Q4_BLOCK // 2] | (q[..., Q4_BLOCK // 2 :] << 4)
    return Q4Weight(nibbles.reshape(weight.shape[0], -1).contiguous(), scale.contiguous(), low.contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor | Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias), [rows, out]; None unless x is a contiguous 2-D CPU float32 tensor of
    at most GEMV_MAX_ROWS rows (Q4_MAX_ROWS for a Q4Weight), weight a contiguous float32 tensor (or a Q4Weight) and bias
    float32 of matching sizes, and the library is built."""
    quantized = isinstance(weight, Q4Weight)
    max_rows = Q4_MAX_ROWS if quantized else GEMV_MAX_ROWS
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.float32 or not 0 < x.shape[0] <= max_rows
            or not x.is_contiguous() or torch.compiler.is_compiling()):
        return None
    if not quantized and (weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_contiguous()):
        return None
    out_features, in_features = weight.shape
    if in_features != x.shape[1]:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,) or not bias.is_contiguous()):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = x.new_empty((x.shape[0], out_features))
    bias_ptr = None if bias is None else bias.data_ptr()
    if quantized:
        library.gemv_q4_f32(x.data_ptr(), weight.nibbles.data_ptr(), weight.scales.data_ptr(),
                            weight.offsets.data_ptr(), bias_ptr, out.data_ptr(), x.shape[0], in_features,
                            out_features, torch.get_num_threads())
    else:
        library.gemv_f32(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), x.shape[0], in_features,
                         out_features, torch.get_num_threads())
    return out


__all__ = ["GEMV_MAX_ROWS", "LIBRARY", "Q4_MAX_ROWS", "Q4Weight", "as_q4", "gemv"]
