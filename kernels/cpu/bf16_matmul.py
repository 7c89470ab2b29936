"""bf16 matmuls for CPUs with AVX512-BF16 or AMX, in C (kernels/cpu/bf16_matmul.c), over a
weight packed once at load as pairs of inputs (`PairWeight`).

Where the CPU has AVX512-BF16 but no AMX, oneDNN's bf16 kernel leaves much of the
arithmetic unused at the row counts of decode steps (8-128 rows) and splits each matmul
between threads up front; this one comes near the VDPBF16PS peak from 32 rows and hands work
out a panel at a time (the .c file says how; benchmarks/RESULTS.md, "Zen 4: CPU kernels" and
"Figures behind design choices in the code", has the times). With AMX the pairs are AMX's own
operand layout and the kernel multiplies with tiles: level with oneDNN's AMX kernel or ahead at
decode sizes, and it lets the one-call C decoder stack run (benchmarks/RESULTS.md, "Xeon (AMX):
CPU kernels").
backend/cpu/linear_methods.py packs every bf16 layer this way where `native()` says the CPU has
the instruction, and keeps no oneDNN copy then. Sums are float32, rounded to bf16 once, as
oneDNN's; only their order differs. Built at first use (kernels/cpu/native_build.py);
`pair_matmul` returns None where it does not apply and the caller runs torch.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .native_build import NativeLibrary, cpu_signature


def _declare(library: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    library.bf16_matmul.argtypes = [p, p, p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.bf16_matmul.restype = None
    library.bf16_matmul_native.restype = ctypes.c_int
    library.bf16_matmul_widened.restype = ctypes.c_int
    library.bf16_matmul_amx.restype = ctypes.c_int
    library.bf16_matmul_amx()  # asks Linux for the tile state once (where built with AMX): tiles from here on


LIBRARY = NativeLibrary(Path(__file__).with_name("bf16_matmul.c"), "CPU bf16 matmul", "oneDNN's bf16 matmul",
                        _declare)

GROUP = 16
"""Outputs whose weights are interleaved (bf16_matmul.c's GROUP): one AVX-512 vector of sums."""


def native() -> bool:
    """Whether engines should use the kernel here: the CPU runs its AVX512-BF16 code and, where it
    has AMX, the library multiplies with tiles too (else oneDNN's AMX kernel, at several times
    VDPBF16PS's rate, stays). Elsewhere it widens the weights to float32 (or, without AVX2,
    runs a plain loop): `deterministic`'s and the tests' only."""
    library = LIBRARY.get()
    return library is not None and bool(library.bf16_matmul_native()) and (not has_amx() or uses_tiles(library))


def instructions() -> str:
    """What the kernel multiplies with here, for reports: "AMX tiles", "AVX512-BF16", "float32
    FMAs" (weights widened: `deterministic` only), "plain loop"."""
    library = LIBRARY.get()
    if library is None:
        return "not built"
    if uses_tiles(library):
        return "AMX tiles"
    if library.bf16_matmul_native():
        return "AVX512-BF16"
    return "float32 FMAs" if library.bf16_matmul_widened() else "plain loop"


TILE_INPUTS = 32
"""Inputs one AMX tile step takes (bf16_matmul.c): a weight goes to the tiles only when its
inputs are a whole number of them (else the VDPBF16PS loop)."""


def multiplies_in_tiles(in_features: int) -> bool:
    """Whether the kernel multiplies a weight of `in_features` inputs with AMX tiles here."""
    return in_features % TILE_INPUTS == 0 and instructions() == "AMX tiles"


def uses_tiles(library: ctypes.CDLL) -> bool:
    """Whether the library multiplies with AMX tiles: built with AMX, and the process granted
    the tile state."""
    return bool(library.bf16_matmul_amx())


@functools.cache
def has_amx() -> bool:
    """Read once: every bf16 layer asks at load (`Linear.pack`), and /proc/cpuinfo does not change."""
    return "amx_bf16" in cpu_signature().split()


@dataclass(frozen=True)
class PairWeight:
    """A bf16 weight [out, in] as bf16_matmul.c reads it: for each group of GROUP outputs and
    each pair of inputs (2k, 2k + 1), the group's weights at both, output by output. Outputs are
    padded to whole groups with zero weights."""

    pairs: torch.Tensor
    """int32 [groups, in / 2, GROUP]: one output's bf16 weights at inputs 2k (low half) and 2k + 1."""
    bias: torch.Tensor | None
    """float32 [groups * GROUP] (zeros past out_features), or None."""
    out_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, 2 * self.pairs.shape[1]

    def unpack(self) -> torch.Tensor:
        """The bf16 weight [out, in] (for callers the C loop declines)."""
        groups, pairs, _ = self.pairs.shape
        weight = self.pairs.view(torch.bfloat16).view(groups, pairs, GROUP, 2).permute(0, 2, 1, 3)
        return weight.reshape(groups * GROUP, 2 * pairs)[: self.out_features]


def pack_pairs(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PairWeight | None:
    """The weight (and bias) in PairWeight's layout; None unless a 2-D CPU bf16 weight with an
    even number of inputs."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu" or weight.shape[1] % 2:
        return None
    out_features, in_features = weight.shape
    pad = -out_features % GROUP
    padded = F.pad(weight.detach(), (0, 0, 0, pad))
    groups = padded.shape[0] // GROUP
    pairs = padded.view(groups, GROUP, in_features // 2, 2).permute(0, 2, 1, 3).contiguous().view(torch.int32)
    if bias is not None:
        bias = F.pad(bias.detach().float(), (0, pad)).contiguous()
    return PairWeight(pairs.view(groups, in_features // 2, GROUP), bias, out_features)


def pair_matmul(x: torch.Tensor, weight: PairWeight) -> torch.Tensor | None:
    """x @ weight.T (+ its bias), bf16 [rows, out]; None unless x is a contiguous 2-D CPU bf16
    tensor of in_features columns outside compilation, and the library is built."""
    groups, pairs, _ = weight.pairs.shape
    in_features = 2 * pairs
    if (not x.is_cpu or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != in_features
            or not 0 < x.shape[0] < 2**31 or not x.is_contiguous() or torch.compiler.is_compiling()):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = x.new_empty((x.shape[0], groups * GROUP))
    library.bf16_matmul(x.data_ptr(), weight.pairs.data_ptr(), None if weight.bias is None else weight.bias.data_ptr(),
                        out.data_ptr(), x.shape[0], in_features, groups, torch.get_num_threads())
    return out if groups * GROUP == weight.out_features else out[:, :weight.out_features].contiguous()


__all__ = ["GROUP", "LIBRARY", "TILE_INPUTS", "PairWeight", "instructions", "multiplies_in_tiles", "native", "pack_pairs",
           "pair_matmul", "uses_tiles"]
