"""The one attention interface of the models: write new K/V to the paged cache,
then attend over it. The kernels (Triton, the CPU attention, or the torch reference)
are chosen once per engine by kernels/dispatch.py; the model's call site never changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.dispatch import attention_kernels

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
    visible_until: torch.Tensor | None = None
    """[num_tokens] int32: the last key position each query sees where some see past themselves (Gemma
    3's image tokens, their whole image); None: causal. Such a step attends through the torch reference."""


@dataclass
class LayerKVCache:
    """One layer's paged K and V, with the per-tensor scales of an fp8 cache (else 1)."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass
class AttentionKernels:
    """The two functions one engine's attention calls (see kernels/dispatch.py)."""

    write_cache: Callable[..., None]
    attend: Callable[..., torch.Tensor]


TORCH_KERNELS = AttentionKernels(*attention_kernels("torch", torch.device("cpu")))


def select_attention_kernels(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionKernels:
    """The kernels for the `attention_backend` setting; auto: Triton on CUDA, the CPU attention on CPU;
    batch_invariant: their batch-invariant forms (`deterministic`)."""
    try:
        return AttentionKernels(*attention_kernels(name, device, batch_invariant))
    except ImportError as error:  # no triton, or one without what the kernels need
        raise ConfigError("attention_backend", f"the Triton attention kernel is not available ({error}); use 'torch'") from None
    except ValueError as error:  # 'cpu' on a GPU, or deterministic with an attention that has no invariant form
        fix = "'auto'" if batch_invariant else "'auto', 'triton' or 'torch'"
        raise ConfigError("attention_backend", f"{error}; use {fix}") from None


def attention(
    kernels: AttentionKernels,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows past the step's tokens (the compiled step pads rows to a bucket) are neither
    written to the cache nor attended; their output rows are zeros. window: a sliding-window
    layer's (each query sees the last `window` positions), None for the whole context; softcap:
    the scores' soft cap (Gemma 2), None for none; sinks: each query head's sink logit (gpt-oss),
    None for none."""
    tokens, rows = meta.slot_mapping.shape[0], query.shape[0]
    if rows > tokens:
        query, key, value = query[:tokens], key[:tokens], value[:tokens]
    scales = dict(k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale)
    kernels.write_cache(key, value, kv_cache.key, kv_cache.value, meta.slot_mapping, **scales)
    spans = {} if meta.visible_until is None else {"visible_until": meta.visible_until}
    out = kernels.attend(
        query, kv_cache.key, kv_cache.value, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        max_seq_len=meta.max_seq_len, window=window, softcap=softcap, sinks=sinks, **scales, **spans,
    )
    return F.pad(out, (0, 0, 0, 0, 0, rows - tokens)) if rows > tokens else out
