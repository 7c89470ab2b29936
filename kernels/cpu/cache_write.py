"""Write new K/V into the paged cache on CPU with one C call per layer (kernels/cpu/cache_write.c).

Same signature and result as `write_kv_cache_ref` (kernels/cache_write.py), which runs
instead where the C file is not built or the tensors are not as it needs them (an fp8 or
other cache dtype that needs quantizing, K/V whose heads are not rows of a token).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..cache_write import write_kv_cache_ref
from .native_build import NativeLibrary


def _declare(library: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.write_kv_cache.argtypes = [p, i64, p, i64, p, p, p, i64, i64, i64]
    library.write_kv_cache.restype = i64


LIBRARY = NativeLibrary(Path(__file__).with_name("cache_write.c"), "CPU KV cache write", "torch ops", _declare)


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    **scales: float | torch.Tensor | None,
) -> None:
    """key/value [num_tokens, kv_heads, head_dim] (rows of a wider tensor allowed);
    caches [num_blocks, block_size, kv_heads, head_dim]; negative slots are skipped.
    scales (k_scale, v_scale) matter only to an fp8 cache, which the reference writes."""
    library = LIBRARY.get() if _takes(key, value, key_cache, value_cache, slot_mapping) else None
    if library is None:
        write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping, **scales)
        return
    size = key.element_size()
    row_bytes = key.shape[1] * key.shape[2] * size
    bad = library.write_kv_cache(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
                                 key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
                                 slot_mapping.numel(), row_bytes, key_cache.shape[0] * key_cache.shape[1])
    if bad:
        raise IndexError(f"{bad} KV cache slot(s) past the cache's {key_cache.shape[0] * key_cache.shape[1]} slots")


def _takes(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           slots: torch.Tensor) -> bool:
    """CPU tensors of one dtype (no quantizing), each token's heads one row, contiguous caches and slots."""
    def rows(x: torch.Tensor) -> bool:
        return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[1:] == key_cache.shape[2:]

    return (key.device.type == "cpu" and key_cache.device.type == "cpu" and not torch.compiler.is_compiling()
            and key.dtype == value.dtype == key_cache.dtype == value_cache.dtype and rows(key) and rows(value)
            and key.shape[0] == value.shape[0] == slots.numel() and key_cache.is_contiguous()
            and value_cache.is_contiguous() and value_cache.shape == key_cache.shape
            and slots.dtype == torch.int64 and slots.is_contiguous())


__all__ = ["LIBRARY", "write_kv_cache_cpu"]
