"""The CPU decode attention that reads the paged cache in place (kernels/cpu/paged_decode.c).

Why C: torch has no CPU op that reads through a block table, so the torch-op path copies
every decode's keys and values out of the cache (index_select) before a flash kernel reads
them again; that copy and the flash kernel's tiling for one query row were a large share of
a decode step (32 sequences, SmolLM2, bf16; benchmarks/RESULTS.md, "Figures behind design
choices in the code"). The C loop reads each key and value row once, where it lies. Built
at first use (kernels/cpu/native_build.py); where it cannot be, `native_decode()` returns None
and the torch-op decode runs instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable

import torch

from .native_build import C_DTYPES, NativeLibrary

NativeDecode = Callable[..., int]


def _declare(library: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.paged_decode.argtypes = [p, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
    library.paged_decode.restype = i32


LIBRARY = NativeLibrary(Path(__file__).with_name("paged_decode.c"), "CPU decode attention",
                        "the slower torch-op decode", _declare)


def native_decode() -> NativeDecode | None:
    """The C decode as a callable (see `paged_decode`), or None where it cannot be built."""
    library = LIBRARY.get()
    return None if library is None else library.paged_decode


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the C loop takes these tensors (fp16 and fp8 caches take the torch-op decode):
    the same float32/bfloat16 dtype for query and cache, a contiguous cache, query heads
    contiguous within a token (its rows may be a view's)."""
    head_dim = query.shape[-1]
    return (query.dtype in C_DTYPES and key_cache.dtype == query.dtype and key_cache.is_contiguous()
            and query.stride(-1) == 1 and query.stride(-2) == head_dim)


def paged_decode(
    function: NativeDecode, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
    tables: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor, scale: float, block_size: int | None = None,
) -> bool:
    """Write the decodes' attention into out[rows] (out contiguous). tables: int32 [num_decodes, width] (this
    step's decodes only), lens: int32 [num_decodes], rows: int64 query rows; block_size: the tables'
    (the cache's where None; 1 for tables of slots, a sliding window's). False when the shapes are
    beyond the C loop's fixed buffers (the caller falls back)."""
    _, cache_block_size, kv_heads, head_dim = key_cache.shape
    block_size = block_size or cache_block_size
    status = function(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), rows.data_ptr(),
        rows.numel(), query.shape[1], kv_heads, head_dim, block_size, scale, C_DTYPES[query.dtype],
        torch.get_num_threads(),
    )
    return status == 0


__all__ = ["LIBRARY", "native_decode", "paged_decode", "supports"]
