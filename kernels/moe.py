"""Mixture-of-experts MLP over a flat batch: each token through the experts it was routed to.

Layout (shared by every implementation):
  x            [tokens, hidden]
  experts      ExpertWeights:
    w13        [experts, 2 * inter, hidden]   each expert's gate_proj rows, then its up_proj rows
    w2         [experts, hidden, inter]       each expert's down_proj
    w13_scale, w2_scale   fp32 [experts, rows]: with e4m3 weights, each output channel's scale
               (W = stored * scale, as kernels/fp8.py's per-channel weights); None in the model dtype
    w13_bias   [experts, 2 * inter], w2_bias [experts, hidden]: the projections' biases (gpt-oss), or None
    clamped_swiglu (alpha, limit): gpt-oss's activation in place of silu(gate) * up (see below)
  topk_ids     [tokens, k] integer            the experts of each token (distinct within a row)
  topk_weights [tokens, k]                    their weights, float32 or the model dtype
Output [tokens, hidden] in x.dtype:
  sum over j of  topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j],
with each projection's bias added where there are biases, and with clamped_swiglu the activation
(up' + 1) * gate' * sigmoid(alpha * gate'), gate' = min(gate, limit), up' = clamp(up, -limit, limit).
Each product is taken in the weights' dtype, rounded to x.dtype, and summed in x.dtype expert by
expert in ascending order: transformers' order, so half-precision results round as its do.
With e4m3 experts each projection is x @ stored^T in float32, times the channel scales, rounded to
x.dtype (kernels/fp8.py's W8A16 reference, expert by expert).

`fused_moe_ref` is the torch reference: the CPU path and the test oracle. It groups the
(token, slot) pairs by expert once (one argsort), then runs two matmuls per expert that has tokens,
its rows in transformers' order, so that float32 results are its bits too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .fp8 import quantize_rows


@dataclass
class ExpertWeights:
    """One layer's experts, stacked (see the module docstring)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    clamped_swiglu: tuple[float, float] | None = None

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None


def quantize_experts_fp8(experts: ExpertWeights) -> ExpertWeights:
    """e4m3 experts with per-output-channel scales (kernels/fp8.py's rounding)."""
    w13, w13_scale = quantize_rows(experts.w13)
    w2, w2_scale = quantize_rows(experts.w2)
    return replace(experts, w13=w13.contiguous(), w2=w2.contiguous(), w13_scale=w13_scale.contiguous(),
                   w2_scale=w2_scale.contiguous())


def _project(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """a @ weight^T in a's dtype (an e4m3 weight in float32 with its channel scales), then + bias."""
    out = F.linear(a, weight) if scale is None else (F.linear(a.float(), weight.float()) * scale).to(a.dtype)
    return out if bias is None else out + bias


def _activate(gate: torch.Tensor, up: torch.Tensor, clamped_swiglu: tuple[float, float] | None) -> torch.Tensor:
    """silu(gate) * up, or gpt-oss's clamped SwiGLU in its order of operations."""
    if clamped_swiglu is None:
        return F.silu(gate) * up
    alpha, limit = clamped_swiglu
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe_ref(
    x: torch.Tensor,
    experts: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum for every token (see the module docstring)."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    tokens_in_batch, inter = x.shape[0], experts.w2.shape[2]
    e = experts
    w13, w2, s13, s2, b13, b2 = e.w13, e.w2, e.w13_scale, e.w2_scale, e.w13_bias, e.w2_bias
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
        gate, up = _project(x[tokens], w13[expert], _row(s13, expert), _row(b13, expert)).split(inter, dim=-1)
        h = _project(_activate(gate, up, e.clamped_swiglu), w2[expert], _row(s2, expert), _row(b2, expert))
        h = h * weights[mine, None]
        out.index_add_(0, tokens, h.to(x.dtype))
    return out


def _row(t: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if t is None else t[expert]


def route(router_logits: torch.Tensor, k: int, renormalize: bool, rounded: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) of each token: the top k of the router's float32 softmax, divided by
    their sum where `renormalize` (Mixtral; Qwen3-MoE's norm_topk_prob), rounded to the logits' dtype
    where `rounded` (Qwen3-MoE), as transformers' routers do; with `softmax_after_topk` (gpt-oss)
    the softmax of the top k logits, in their dtype."""
    if softmax_after_topk:
        top, ids = torch.topk(router_logits, k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(router_logits.dtype) if rounded else weights), ids


__all__ = ["ExpertWeights", "fused_moe_ref", "quantize_experts_fp8", "route"]
