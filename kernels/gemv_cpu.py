"""float32 matrix-vector products for CPU in C (kernels/gemv_cpu.c): a decoding sequence's
matmuls, bound by how fast the weights stream from memory.

`gemv` multiplies a few rows by a float32 weight as the checkpoint stores it, [out, in] (up to
GEMV_MAX_ROWS), or by a `BlockWeight`: the GGUF Q4_1 / Q8_0 blocks that rebuild a float32
weight exactly (`as_blocks`, up to BLOCK_MAX_ROWS), the same values in a sixth or a third of
the bytes. backend/models/linear.py sends its small steps here (the "both" layout of
backend/matmul_probe.py, and any float32 weight with exact blocks). Built at first use
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
    library.gemv_blocks_f32.argtypes = [p, p, p, p, p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                        ctypes.c_int]
    library.gemv_blocks_f32.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("gemv_cpu.c"), "CPU float32 GEMV", "torch's matmul", _declare)


BLOCK_MAX_ROWS = 8
"""Rows per call for a BlockWeight (gemv_cpu.c's BLOCK_MAX_ROWS): it reads a third to a sixth
of the bytes, so its dot products stay cheaper than oneDNN's float32 kernel over more rows."""
BLOCK = 32
"""Inputs per block (one scale and one offset each), as in GGUF's Q4_1 and Q8_0."""
BLOCK_KINDS = {"q4_1": 0, "q8_0": 1}
"""gemv_cpu.c's codes for the block formats."""


@dataclass(frozen=True)
class BlockWeight:
    """A float32 weight [out, in] each of whose blocks of 32 inputs is d * q + m, d and m values
    of fp16: q in 0..15 (GGUF Q4_1) or q in -127..127 and m = 0 (GGUF Q8_0), which is what a
    GGUF checkpoint of those formats dequantizes to (the bundled model's layers and its
    embedding). Kept as those parts it is the same weight, bit for bit, in 0.75 (Q4_1) or 1.25
    bytes a value instead of 4: a single stream's decode streams a third to a sixth of the bytes."""

    kind: str
    """"q4_1" or "q8_0"."""
    codes: torch.Tensor
    """uint8 [out, in / 32 * bytes a block]: Q4_1's byte j of a block holds input j (low nibble)
    and j + 16 (high); Q8_0's are the int8 q."""
    scales: torch.Tensor
    """float32 [out, in / 32]: d of each block."""
    offsets: torch.Tensor
    """float32 [out, in / 32]: m of each block (zeros for Q8_0)."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK


def as_blocks(weight: torch.Tensor) -> BlockWeight | None:
    """The weight as Q4_1 parts, else Q8_0 parts, or None unless every value is rebuilt exactly
    from them (checked here, so a weight that merely looks quantized is never approximated)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    if weight.shape[0] > 1 and as_blocks(weight[:1]) is None:  # most weights fail at once: a cheap look first
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    low = blocks.amin(-1)  # Q4_1's m: the block's smallest value has q = 0, its largest q = 15
    found = _exact_codes(blocks, (blocks.amax(-1) - low) / 15, low, 0, 15)
    if found is not None:
        q, scale = found[0].to(torch.uint8), found[1]
        return _block_weight("q4_1", q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4), scale, low)
    zero = torch.zeros_like(low)  # Q8_0: the block's largest magnitude has q = +-127
    found = _exact_codes(blocks, blocks.abs().amax(-1) / 127, zero, -127, 127)
    if found is not None:
        return _block_weight("q8_0", found[0].to(torch.int8).view(torch.uint8), found[1], zero)
    return None


def _exact_codes(blocks: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, lowest: int,
                 highest: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, the scale rounded to fp16) with scale * q + offset == blocks exactly, or None (the
    offset must be an fp16 value already)."""
    scale = scale.half().float()
    if not torch.equal(offset.half().float(), offset) or not bool(torch.isfinite(scale).all()):
        return None
    step = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = torch.where(scale[..., None] > 0, torch.round((blocks - offset[..., None]) / step), torch.zeros_like(blocks))
    if bool((q < lowest).any()) or bool((q > highest).any()):
        return None
    return (q, scale) if torch.equal(scale[..., None] * q + offset[..., None], blocks) else None


def _block_weight(kind: str, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> BlockWeight:
    return BlockWeight(kind, codes.reshape(codes.shape[0], -1).contiguous(), scale.contiguous(), offset.contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias), [rows, out]; None unless x is a contiguous 2-D CPU float32 tensor of
    at most GEMV_MAX_ROWS rows (BLOCK_MAX_ROWS for a BlockWeight), weight a contiguous float32 tensor (or a BlockWeight) and bias
    float32 of matching sizes, and the library is built."""
    quantized = isinstance(weight, BlockWeight)
    max_rows = BLOCK_MAX_ROWS if quantized else GEMV_MAX_ROWS
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
        library.gemv_blocks_f32(x.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(),
                                weight.offsets.data_ptr(), bias_ptr, out.data_ptr(), x.shape[0], in_features,
                                out_features, BLOCK_KINDS[weight.kind], torch.get_num_threads())
    else:
        library.gemv_f32(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), x.shape[0], in_features,
                         out_features, torch.get_num_threads())
    return out


__all__ = ["BLOCK_MAX_ROWS", "GEMV_MAX_ROWS", "LIBRARY", "BlockWeight", "as_blocks", "gemv"]
