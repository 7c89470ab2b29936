"""float32 matmuls for CPU in C (kernels/cpu/block_matmul.c) over a weight kept as the GGUF
Q4_1 / Q8_0 blocks that rebuild it exactly: the same float32 values in a sixth or a third of
the bytes.

A model read from a GGUF checkpoint of those formats (the bundled one) has float32 weights that
are exactly d * q + m per block of 32 inputs. `as_blocks` recovers those parts at load and keeps
them only if they rebuild every value bit for bit; `block_matmul` multiplies by them at any row
count: a few rows (decoding sequences) through a loop bound by how fast the blocks stream, more
rows (batches, prefill chunks) through a register-tiled GEMM bound by the FMA units, level
with or faster than oneDNN's packed float32 kernel on a 2-core AVX2 EPYC
(benchmarks/cpu_matmul.py; benchmarks/RESULTS.md, "Figures behind design choices in the
code"). The weights are the float32 ones, so only the order of the sums differs from
torch's. The blocks of 16 consecutive outputs are kept interleaved (`BlockWeight`), so that
both loops multiply a vector of 16 outputs' weights by one input value at a time and never
sum across vector lanes.
backend/cpu/linear_methods.py sends every float32 step of such a layer here. Built at first use
(kernels/cpu/native_build.py); returns None where it does not apply, and the caller runs torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .gemv import operands_fit
from .native_build import NativeLibrary


def _declare(library: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    library.block_matmul_f32.argtypes = [p, p, p, p, p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_int]
    library.block_matmul_f32.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("block_matmul.c"), "CPU GGUF-block matmul", "torch's matmul",
                        _declare)

GEMV_ROWS = 8
"""Up to this many rows (block_matmul.c's GEMV_UP_TO) each group's blocks are expanded in
registers and used by every row at once: the blocks stream once, and a few rows cost little
more than one. More rows go through the GEMM, which expands them into L1 once per panel."""

BLOCK = 32
"""Inputs per block (one scale and one offset each), as in GGUF's Q4_1 and Q8_0."""
BLOCK_KINDS = {"q4_1": 0, "q8_0": 1}
"""block_matmul.c's codes for the block formats."""
GROUP = 16
"""Outputs whose blocks are interleaved (block_matmul.c's GROUP): one AVX-512 vector."""


@dataclass(frozen=True)
class BlockWeight:
    """A float32 weight [out, in] each of whose blocks of 32 inputs is d * q + m, d and m values
    of fp16: q in 0..15 (GGUF Q4_1) or q in -127..127 and m = 0 (GGUF Q8_0), which is what a
    GGUF checkpoint of those formats dequantizes to (the bundled model's layers and its
    embedding). Kept as those parts it is the same weight, bit for bit, in 0.75 (Q4_1) or 1.25
    bytes a value instead of 4: a single stream's decode streams a third to a sixth of the bytes.

    The parts of GROUP consecutive outputs are interleaved: for each block position, the bytes of
    one input position for all GROUP outputs lie together, which the C loops expand into a
    vector of GROUP outputs' weights at one input. Outputs are padded to a multiple of GROUP with
    zero weights (d = m = q = 0)."""

    kind: str
    """"q4_1" or "q8_0"."""
    codes: torch.Tensor
    """uint8 [groups, in / 32, bytes a block, GROUP]: a GGUF block's bytes, output by output along
    the last axis. Q4_1: byte j holds input j (low nibble) and j + 16 (high); Q8_0: the int8 q."""
    scales: torch.Tensor
    """float32 [groups, in / 32, GROUP]: d of each block."""
    offsets: torch.Tensor
    """float32 [groups, in / 32, GROUP]: m of each block (zeros for Q8_0)."""
    out_features: int
    batch_invariant: bool = False
    """A row's sums in one order whatever the row count (block_matmul.c's `batch_invariant`:
    the few-row loop with one chain); else one or two rows may sum in several chains."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.scales.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the parts rebuild, bit for bit (for callers the C loops decline)."""
        groups, blocks, _ = self.scales.shape
        codes = self.codes.permute(0, 3, 1, 2)  # [groups, GROUP, blocks, bytes]
        if self.kind == "q8_0":
            q = codes.view(torch.int8).float()
        else:
            q = torch.cat([codes & 15, codes >> 4], dim=-1).float()
        weight = torch.addcmul(self.offsets.transpose(1, 2)[..., None], self.scales.transpose(1, 2)[..., None], q)
        return weight.reshape(groups * GROUP, blocks * BLOCK)[: self.out_features]


def grid_weight(kind: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A random float32 weight exactly as a GGUF checkpoint of `kind` dequantizes (per block of 32,
    d * q + m with fp16 d and m), which `as_blocks` takes: for timing the block matmul
    (backend/cpu/matmul_probe.py) and testing it. Q4_1: q in 0..15 with a 0 and a 15 in each block,
    as the quantizer leaves them; Q8_0: m = 0, q in -127..127 with a -127 in each block."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // BLOCK
    if kind == "q4_1":
        d = (torch.rand(out_features, blocks, generator=g) * 0.01).half().float()
        m = (-torch.rand(out_features, blocks, generator=g) * 0.05).half().float()
        q = torch.randint(0, 16, (out_features, blocks, BLOCK), generator=g).float()
        q[..., 5], q[..., 27] = 0, 15
    elif kind == "q8_0":
        d = (torch.rand(out_features, blocks, generator=g) * 0.001).half().float()
        m = torch.zeros_like(d)
        q = torch.randint(-127, 128, (out_features, blocks, BLOCK), generator=g).float()
        q[..., 9] = -127
    else:
        raise ValueError(f"block kind must be one of {sorted(BLOCK_KINDS)}, got {kind!r}")
    return (d[..., None] * q + m[..., None]).reshape(out_features, in_features)


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
    """Interleave GROUP outputs' parts: codes [out, blocks, bytes], scale and offset [out, blocks]."""
    out_features = codes.shape[0]
    pad = -out_features % GROUP
    if pad:
        codes, scale, offset = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (codes, scale, offset))
    groups = codes.shape[0] // GROUP
    return BlockWeight(
        kind,
        codes.view(groups, GROUP, *codes.shape[1:]).permute(0, 2, 3, 1).contiguous(),
        scale.view(groups, GROUP, -1).transpose(1, 2).contiguous(),
        offset.view(groups, GROUP, -1).transpose(1, 2).contiguous(),
        out_features,
    )


def block_matmul(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T (+ bias), [rows, out], for the float32 weight the blocks rebuild; None unless
    the operands fit (gemv_cpu.operands_fit, any number of rows) and the library is built."""
    out_features, in_features = weight.shape
    if not operands_fit(x, out_features, in_features, bias, 2**31 - 1):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    groups = weight.scales.shape[0]
    padded = groups * GROUP
    if bias is not None and padded != out_features:
        bias = F.pad(bias, (0, padded - out_features))
    out = x.new_empty((x.shape[0], padded))
    library.block_matmul_f32(x.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(), weight.offsets.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], in_features,
                             groups, BLOCK_KINDS[weight.kind], int(weight.batch_invariant), torch.get_num_threads())
    return out if padded == out_features else out[:, :out_features].contiguous()


__all__ = ["GEMV_ROWS", "GROUP", "LIBRARY", "BlockWeight", "as_blocks", "block_matmul", "grid_weight"]
