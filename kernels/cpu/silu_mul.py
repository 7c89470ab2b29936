"""SiLU(gate) * up for CPU float32 or bfloat16 in one C pass (kernels/cpu/silu_mul.c).

The MLP's activation after the fused gate_up projection: torch's SiLU over the gate half and
the product with the up half were a noticeable part of a 2,048-token prefill step on a 2-core
Xeon; one pass over both halves takes far less (benchmarks/RESULTS.md, "Xeon (no AMX): CPU
kernels" and "Figures behind design choices in the code"). Built at first use
(kernels/cpu/native_build.py); `silu_mul` returns None where it does not apply (not float32 or
bfloat16 / contiguous / CPU, inside a compiled graph, no AVX2, no compiler) and the caller
runs torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import C_DTYPES, NativeLibrary


def _declare(library: ctypes.CDLL) -> bool:
    if not library.silu_mul_available():  # built without AVX-512: nothing here
        return False
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.silu_mul.argtypes = [p, p, i64, i64, i32, i32]
    library.silu_mul.restype = None
    return True


LIBRARY = NativeLibrary(Path(__file__).with_name("silu_mul.c"), "CPU SiLU x up", "torch ops", _declare)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [rows, 2n] (gate first), [rows, n]; None where it does not apply."""
    if (gate_up.device.type != "cpu" or gate_up.dtype not in C_DTYPES or gate_up.dim() != 2 or gate_up.shape[1] % 2
            or not gate_up.is_contiguous() or torch.compiler.is_compiling()):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, n))
    library.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads(),
                     C_DTYPES[gate_up.dtype])
    return out


__all__ = ["LIBRARY", "silu_mul"]
