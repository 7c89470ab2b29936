"""The CPU prefill attention that reads the paged cache in place (kernels/cpu/paged_prefill.c).

Why C: torch has no CPU attention that reads through a block table or takes chunks of
different lengths at once, so each prefill chunk gathered its keys and values and ran its
own flash SDPA call, per layer: far below the FMA peak on the short prompts of a serving
burst, and a noticeable part of a 2,048-token step (benchmarks/RESULTS.md, "Figures behind
design choices in the code"). The C loop takes every chunk of the step in one call (float32 or
bfloat16, bf16 multiplied in pairs by VDPBF16PS where the CPU has AVX512-BF16; AVX-512 or
AVX2: without them `native_prefill()` is None; other dtypes or shapes are declined; SDPA runs
there).
The torch reference (kernels/paged_attention.py) is the test oracle.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .native_build import C_DTYPES, NativeLibrary
from .paged_decode import supports as decode_supports

NativePrefill = Callable[..., int]


def _declare(library: ctypes.CDLL) -> bool:
    if not library.paged_prefill_available():  # built without AVX2: nothing here
        return False
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.paged_prefill.argtypes = [p, i64, p, p, p, p, p, p, p, p, i32, i32, i32, i32, ctypes.c_float, i32, i32]
    library.paged_prefill.restype = i32
    return True


LIBRARY = NativeLibrary(Path(__file__).with_name("paged_prefill.c"), "CPU prefill attention",
                        "torch's SDPA per chunk", _declare)


def native_prefill() -> NativePrefill | None:
    """The C prefill as a callable (see `paged_prefill`), or None where it cannot be built."""
    library = LIBRARY.get()
    return None if library is None else library.paged_prefill


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """What the C decode takes (paged_decode_cpu.supports: float32 or bfloat16 query and
    cache alike, the layout)."""
    return decode_supports(query, key_cache)


@dataclass(frozen=True)
class PrefillChunks:
    """A step's prefill chunks as the C loop takes them: chunk c's query rows q_starts[c] ..
    + q_lens[c] against keys at slots[slot_starts[c] .. + seq_lens[c]] (cache rows)."""

    slots: torch.Tensor  # int64, every chunk's key slots one after another
    slot_starts: torch.Tensor  # int64 [chunks]
    q_starts: torch.Tensor  # int32 [chunks]
    q_lens: torch.Tensor  # int32 [chunks]
    seq_lens: torch.Tensor  # int32 [chunks]

    @classmethod
    def of(cls, starts: list[int], ends: list[int], slots: list[torch.Tensor]) -> PrefillChunks:
        lens = [s.numel() for s in slots]
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        q_lens = [e - s for s, e in zip(starts, ends)]
        return cls(torch.cat(slots).long().contiguous(), torch.tensor(offsets, dtype=torch.int64),
                   torch.tensor(starts, dtype=torch.int32), torch.tensor(q_lens, dtype=torch.int32),
                   torch.tensor(lens, dtype=torch.int32))


def paged_prefill(function: NativePrefill, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  out: torch.Tensor, chunks: PrefillChunks, scale: float) -> bool:
    """Write every chunk's attention into out's rows (out contiguous [tokens, heads, dim], the query's dtype);
    False where the C loop does not take the shapes (the caller falls back)."""
    _, _, kv_heads, head_dim = key_cache.shape
    status = function(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        chunks.slots.data_ptr(), chunks.slot_starts.data_ptr(), chunks.q_starts.data_ptr(), chunks.q_lens.data_ptr(),
        chunks.seq_lens.data_ptr(), chunks.q_lens.numel(), query.shape[1], kv_heads, head_dim, scale,
        torch.get_num_threads(), C_DTYPES[query.dtype],
    )
    return status == 0


__all__ = ["LIBRARY", "PrefillChunks", "native_prefill", "paged_prefill", "supports"]
