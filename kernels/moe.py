"""Mixture-of-experts MLP over a flat batch: each token through the experts it was routed to.

Layout (shared by every implementation):
  x            [tokens, hidden]
  w13          [experts, 2 * inter, hidden]   each expert's gate_proj rows, then its up_proj rows
  w2           [experts, hidden, inter]       each expert's down_proj
  topk_ids     [tokens, k] integer            the experts of each token (distinct within a row)
  topk_weights [tokens, k]                    their weights, float32 or the model dtype
Output [tokens, hidden] in x.dtype:
  sum over j of  topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j].
Each product is taken in the weights' dtype, rounded to x.dtype, and summed in x.dtype expert by
expert in ascending order: transformers' order, so half-precision results round as its do.

`fused_moe_ref` is the torch reference: the CPU path and the test oracle. It groups the
(token, slot) pairs by expert once (one argsort), then runs two matmuls per expert that has tokens,
its rows in transformers' order, so that float32 results are its bits too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum for every token (see the module docstring)."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    tokens_in_batch, inter = x.shape[0], w2.shape[2]
    # (slot, token) pairs, slot-major as transformers walks them: grouped by expert (a stable sort),
    # each expert's rows in its order, which its matmuls' float32 bits follow
    by_slot = topk_ids.t().reshape(-1)
    pairs = by_slot.argsort(stable=True)
    counts = torch.bincount(by_slot, minlength=w13.shape[0]).tolist()
    weights = topk_weights.t().reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        mine = pairs[start : start + count]
        start += count
        tokens = mine % tokens_in_batch
        gate, up = F.linear(x[tokens], w13[expert]).split(inter, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert]) * weights[mine, None]
        out.index_add_(0, tokens, h.to(x.dtype))
    return out


def route(router_logits: torch.Tensor, k: int, renormalize: bool, rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) of each token: the top k of the router's float32 softmax, divided by
    their sum where `renormalize` (Mixtral; Qwen3-MoE's norm_topk_prob), rounded to the logits' dtype
    where `rounded` (Qwen3-MoE), as transformers' routers do."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(router_logits.dtype) if rounded else weights), ids


__all__ = ["fused_moe_ref", "route"]
