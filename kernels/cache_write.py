"""Scatter the new tokens' K/V into their cache slots (slot = block * block_size + offset).

Negative slots mean "skip this token" (padding). A float8_e4m3fn cache is
quantized with a per-tensor scale: stored = clamp(x / scale, -448, 448), computed
in float32 and rounded to nearest-even (scales are ignored for other dtypes).
The Triton kernel of the same signature is `write_kv_cache_triton` in
kernels/triton/cache_write.py; this module imports no triton.
"""

from __future__ import annotations

import torch

from .numerics import FP8_DTYPE, FP8_MAX


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """key/value [num_tokens, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        x = quantize(x, cache.dtype, scale)
        if cache.dtype == FP8_DTYPE:  # index_put may lack fp8 kernels: write the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, *cache.shape[2:])[slot_mapping] = x


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor | None) -> torch.Tensor:
    """x in the cache dtype; fp8: clamp(x / scale) in float32, then round to nearest-even."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    s = 1.0 if scale is None else float(scale)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(dtype)
