"""Greedy decoding's argmax for CPU float32 logits in C (kernels/cpu/first_max.c).

torch's max(dim) over a step's logits ([sequences, vocab], float32) ran slowly on 2 cores, a
share of a 32-sequence decode step worth taking back; one AVX-512 pass a row is several times
faster (AVX2: 8 lanes a pass; benchmarks/RESULTS.md, "Zen 4: CPU kernels" and "Figures behind
design choices in the code"). Same answer as argmax: the first index of the maximum, a NaN
counting as the largest. Built at first use (kernels/cpu/native_build.py); `first_max_index`
returns None where it does not apply and the caller runs torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native_build import NativeLibrary


def _declare(library: ctypes.CDLL) -> bool:
    if not library.first_max_available():  # built without AVX2: nothing here
        return False
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.first_max.argtypes = [p, i64, i64, p, ctypes.c_int]
    library.first_max.restype = None
    return True


LIBRARY = NativeLibrary(Path(__file__).with_name("first_max.c"), "CPU greedy argmax", "torch's max", _declare)


def first_max_index(rows: torch.Tensor) -> torch.Tensor | None:
    """int64 [rows]: each row's first maximum; None unless a contiguous 2-D CPU float32 tensor
    (columns < 2^31) and the library is built."""
    if (rows.device.type != "cpu" or rows.dtype != torch.float32 or rows.dim() != 2 or not rows.is_contiguous()
            or rows.shape[1] == 0 or rows.shape[1] >= 2**31 or torch.compiler.is_compiling()):
        return None
    library = LIBRARY.get()
    if library is None:
        return None
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    library.first_max(rows.data_ptr(), rows.shape[0], rows.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


__all__ = ["LIBRARY", "first_max_index"]
