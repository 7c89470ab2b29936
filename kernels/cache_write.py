"""Scatter the new tokens' K/V into their cache slots (slot = block * block_size + offset)."""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [num_tokens, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]."""
    key_cache.view(-1, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slot_mapping] = value.to(value_cache.dtype)
