"""Paged attention over a flat batch mixing prefill chunks and single-token decodes.

Layout (shared by every implementation):
  query        [num_tokens, num_heads, head_dim]   new tokens of all sequences, concatenated
  key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
  block_tables [num_seqs, max_blocks] int32   physical block of each logical block
  seq_lens     [num_seqs] int32   tokens in the context after this step (cached + new)
  query_start_loc [num_seqs + 1] int32   offsets of each sequence's new tokens in query
A sequence's new tokens sit at the end of its context: query token i of a
sequence with q new tokens and context s attends to keys 0 .. s - q + i.
GQA: query head h reads kv head h // (num_heads // num_kv_heads).

Sliding window (keyword-only `window`, None: full causal): the query at position p attends
to keys p - window < k <= p, the last `window` positions (transformers' sliding_window
mask), so Mistral and Gemma's local layers run past the window exactly.

Soft-capping (keyword-only `softcap`, Gemma 2): each score s (after the softmax scale) becomes
softcap * tanh(s / softcap) before the softmax.

Attention sinks (keyword-only `sinks`, gpt-oss: float [num_heads]): each head's softmax has one
more logit, its sink, in the denominator and no value: out = sum_k e^(s_k) v_k / (e^(sink) +
sum_k e^(s_k)), so a head may attend to nothing in particular.

Bidirectional spans (keyword-only `visible_until`, the torch reference only: int [num_tokens]): query
token t sees keys up to position visible_until[t] of its sequence instead of its own (Gemma 3's image
tokens see their whole image); a chunk holds every token such a span lets a query see.

FP8 KV cache: key_cache/value_cache may be torch.float8_e4m3fn with per-tensor
scales (keyword-only k_scale, v_scale; dequantized = stored * scale; scales are
ignored for other cache dtypes, and default to 1.0).

`paged_attention_ref` is the torch reference: the CPU path and the test oracle.
It imports no triton; the Triton kernel is `paged_attention_triton` in
kernels/triton/paged_attention.py (same signature).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .numerics import FP8_DTYPE, cdiv


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    visible_until: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decodes are batched (one gather, one padded SDPA with GQA folded into the
    query axis); prefill chunks run one sequence at a time.

    An fp8 cache is dequantized after the gather (only the blocks read), in
    float32 then cast to the query dtype, so the oracle adds no fp8-specific error."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    fp8 = is_fp8(key_cache)
    ks, vs = kv_scales(key_cache, k_scale, v_scale)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(query)
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        rows = torch.tensor(decodes, dtype=torch.long, device=query.device)
        tokens = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=query.device)
        context = torch.tensor([lens[i] for i in decodes], device=query.device)
        max_len = max(lens[i] for i in decodes)
        num_blocks = cdiv(max_len, block_size)
        table = block_tables[rows, :num_blocks].long()
        keys = _gather(key_cache, table)  # [b, kvh, L, d]
        values = _gather(value_cache, table)
        if fp8:
            keys, values = _dequant(keys, ks, query.dtype), _dequant(values, vs, query.dtype)
        q = query[tokens].view(len(decodes), num_kv_heads, -1, head_dim)
        positions = torch.arange(keys.shape[2], device=query.device)
        mask = positions[None, :] < context[:, None]
        if window is not None:
            mask &= positions[None, :] >= context[:, None] - window
        mask = mask[:, None, None, :]
        sink = None if sinks is None else sinks.view(num_kv_heads, -1, 1)  # the heads as q folds them
        attn = _attend(q, keys, values, mask, scale, softcap, sink)
        out[tokens] = attn.reshape(len(decodes), -1, head_dim)
    for i in range(len(lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            continue
        seq_len = lens[i]
        num_blocks = cdiv(seq_len, block_size)
        table = block_tables[i : i + 1, :num_blocks].long()
        keys = _gather(key_cache, table)[0, :, :seq_len]  # [kvh, L, d]
        values = _gather(value_cache, table)[0, :, :seq_len]
        if fp8:
            keys, values = _dequant(keys, ks, query.dtype), _dequant(values, vs, query.dtype)
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)  # [h, q, d]
        if visible_until is not None:
            until = visible_until[starts[i] : starts[i + 1]].to(query.device)[:, None]
            visible = visible_keys(q_len, seq_len, window, query.device)
            key_positions = torch.arange(seq_len, device=query.device)[None, :]
            own = torch.arange(q_len, device=query.device)[:, None] + (seq_len - q_len)
            visible |= (key_positions > own) & (key_positions <= until)  # a span's later keys too
            sink = None if sinks is None else sinks.view(-1, 1, 1)
            attn = _attend(q, keys, values, visible, scale, softcap, sink)
        elif seq_len == q_len and (window is None or window >= seq_len) and softcap is None and sinks is None:
            attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            sink = None if sinks is None else sinks.view(-1, 1, 1)
            attn = _attend(q, keys, values, visible_keys(q_len, seq_len, window, query.device), scale, softcap, sink)
        out[starts[i] : starts[i + 1]] = attn.transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA (GQA: q's heads a multiple of k's); with `softcap` or `sink` (the sink logits, shaped
    to broadcast against the scores' [..., rows, 1]) the same in plain ops, in transformers' eager
    order (SDPA has neither): scores in the query dtype, capped, softmax in float32 (over the
    sink's logit too, which then drops out)."""
    if softcap is None and sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # a column of its own
        column = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def visible_keys(q_len: int, seq_len: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """[q_len, seq_len] bool: the last q_len of seq_len positions see keys up to their own
    position (lower-right causal), and with a window only the last `window` of those."""
    keys = torch.arange(seq_len, device=device)[None, :]
    rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    visible = keys <= rows
    if window is not None:
        visible &= keys > rows - window
    return visible


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[b, blocks] block ids -> [b, kv_heads, blocks * block_size, head_dim] (a strided view).

    index_select over whole blocks as rows is several times faster on CPU than
    advanced indexing."""
    b, n = table.shape
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    raw = cache.view(torch.uint8) if is_fp8(cache) else cache  # index_select may lack fp8 kernels
    rows = raw.view(num_blocks, -1).index_select(0, table.reshape(-1)).view(cache.dtype)
    return rows.view(b, n * block_size, kv_heads, head_dim).transpose(1, 2)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def kv_scales(
    cache: torch.Tensor, k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None
) -> tuple[float, float]:
    """Per-tensor scales as Python floats: 1.0 when absent or when the cache is not fp8."""
    if not is_fp8(cache):
        return 1.0, 1.0
    return (1.0 if k_scale is None else float(k_scale)), (1.0 if v_scale is None else float(v_scale))


def _dequant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)
