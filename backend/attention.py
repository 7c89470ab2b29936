"""The one attention interface of the models: write new K/V to the paged cache,
then attend over it. The implementation (torch reference or Triton kernel) is
chosen once per engine; the model's call site never changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pagedserve.kernels import paged_attention_ref, write_kv_cache_ref

from .errors import ConfigError


@dataclass
class AttentionMetadata:
    """Flat-batch layout of one step, built by the ModelRunner (see kernels/paged_attention.py)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int


@dataclass
class LayerKVCache:
    """One layer's paged K and V, with the per-tensor scales of an fp8 cache (else 1)."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass
class AttentionBackend:
    write_cache: Callable[..., None]
    attend: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend(write_cache=write_kv_cache_ref, attend=paged_attention_ref)


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: the Triton kernels on CUDA, the torch reference elsewhere."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TORCH_BACKEND
    try:
        from pagedserve.kernels.dispatch import triton_attention_backend  # needs triton
    except ImportError as error:
        raise ConfigError("attention_backend", f"the Triton attention kernel is not available ({error}); use 'torch'") from None
    return triton_attention_backend()


def attention(
    backend: AttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    scales = dict(k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale)
    backend.write_cache(key, value, kv_cache.key, kv_cache.value, meta.slot_mapping, **scales)
    return backend.attend(
        query, kv_cache.key, kv_cache.value, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        max_seq_len=meta.max_seq_len, **scales,
    )
