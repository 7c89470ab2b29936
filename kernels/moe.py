"""Mixture-of-experts MLP over a flat batch: each token through the experts it was routed to.

Layout (shared by every implementation):
  x            [tokens, hidden]
  experts      ExpertWeights, in one of three forms (`ExpertWeights.form`):
    dense      w13 [experts, 2 * inter, hidden]  each expert's gate_proj rows, then its up_proj rows
               w2  [experts, hidden, inter]      each expert's down_proj
    "fp8"      w13 / w2 e4m3 in the same layout, w13_scale / w2_scale fp32: [experts, rows] one per
               output channel (group_size 0), or [experts, rows, ceil(cols / group_size)] per channel
               and group of input features (block-wise checkpoints): an expert's slice is an
               Fp8Weight (kernels/fp8.py)
    "int8"     the same with int8 codes (W8A16 checkpoints): an expert's slice is an Int8Weight
    "mxfp4"    w13 uint8 [experts, 2 * inter, hidden / 2], w2 uint8 [experts, hidden, inter / 2]: two
               e2m1 codes a byte along K; w13_scale / w2_scale uint8 e8m0 [experts, rows, cols / 32]
               (group_size 32): an expert's slice is an Mxfp4Weight (kernels/mxfp4.py; gpt-oss)
    "int4"     w13 int32 [experts, hidden / 8, 2 * inter], w2 int32 [experts, inter / 8, hidden],
               w13_scale / w13_offset [experts, hidden / group_size, 2 * inter] (w2's likewise):
               an expert's slice is an Int4Weight (kernels/int4.py: codes packed along K, N
               contiguous, W = code * scale + offset), the layout AWQ / GPTQ / compressed-tensors
               experts are repacked into
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
With quantized experts each projection is the quantized linear's reference (kernels/fp8.py's W8A16,
kernels/int4.py's W4A16, kernels/mxfp4.py's: float32, rounded to x.dtype), expert by expert.

`fused_moe_ref` is the torch reference: the CPU path and the test oracle. It groups the
(token, slot) pairs by expert once (one argsort), then runs two matmuls per expert that has tokens,
its rows in transformers' order, so that float32 results are its bits too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Sequence, Union

import torch
import torch.nn.functional as F

from .fp8 import Fp8Weight, Int8Weight, fp8_matmul_ref, quantize_rows
from .int4 import PACK, Int4Weight, int4_group_size, quantize_int4, w4a16_matmul_ref
from .mxfp4 import Mxfp4Weight, mxfp4_matmul_ref

Projection = Union[torch.Tensor, Fp8Weight, Int4Weight, Mxfp4Weight]
"""One expert's gate / up (stacked rows) or down weight, in whichever form the experts have."""


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
    w13_offset: torch.Tensor | None = None
    w2_offset: torch.Tensor | None = None
    group_size: int = 0
    """int4: the group along K; fp8 / int8: 0 (per-channel scales) or the group of its grouped
    scales; mxfp4: 32."""

    @property
    def form(self) -> Literal["dense", "fp8", "int8", "int4", "mxfp4"]:
        forms = {torch.int32: "int4", torch.int8: "int8", torch.uint8: "mxfp4"}
        if self.w13.dtype in forms:
            return forms[self.w13.dtype]  # type: ignore[return-value]  # the dict's values are the literals
        return "dense" if self.w13_scale is None else "fp8"

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[2] if self.form == "int4" else self.w2.shape[1]

    @property
    def inter(self) -> int:
        if self.form == "int4":
            return self.w2.shape[1] * PACK
        return self.w2.shape[2] * (2 if self.form == "mxfp4" else 1)

    def projection(self, which: Literal["w13", "w2"], expert: int) -> Projection:
        """Expert `expert`'s gate / up ("w13") or down ("w2") weight: a tensor, or its quantized
        form's weight object (whose reference matmul `_project` takes)."""
        weight, scale = (self.w13, self.w13_scale) if which == "w13" else (self.w2, self.w2_scale)
        if self.form == "dense":
            return weight[expert]
        assert scale is not None  # quantized forms carry scales
        if self.form in ("fp8", "int8"):
            kind = Fp8Weight if self.form == "fp8" else Int8Weight
            return kind(weight[expert], scale[expert], self.group_size)
        if self.form == "mxfp4":
            return Mxfp4Weight(weight[expert], scale[expert])
        offset = self.w13_offset if which == "w13" else self.w2_offset
        assert offset is not None  # int4 carries offsets
        rows, cols = weight.shape[1:]
        return Int4Weight(weight[expert], scale[expert], offset[expert], self.group_size, (cols, rows * PACK))


def stack_experts(w13: Sequence[Projection], w2: Sequence[Projection], **rest) -> ExpertWeights:
    """The ExpertWeights of every expert's fused gate / up weight and down weight, all in one form
    (per-expert Fp8Weights, Int8Weights or Int4Weights, as a quantized checkpoint's experts load);
    `rest`: ExpertWeights' other fields (biases, clamped_swiglu)."""
    forms = {type(w) for w in (*w13, *w2)}
    if len(forms) != 1:
        raise ValueError(f"experts in mixed forms {sorted(f.__name__ for f in forms)}")
    form = forms.pop()
    groups = {getattr(w, "group_size", 0) for w in (*w13, *w2)}
    if form is Int4Weight:
        group = math.gcd(*groups)  # per-channel weights' groups are their widths: hidden for w13, inter for w2
        a = [_regrouped(w, group) for w in w13 if isinstance(w, Int4Weight)]
        b = [_regrouped(w, group) for w in w2 if isinstance(w, Int4Weight)]
        if any(w.perm is not None for w in (*a, *b)):
            raise ValueError("4-bit experts with act-order (GPTQ desc_act) are not supported")
        return ExpertWeights(
            _stack(w.qweight for w in a), _stack(w.qweight for w in b), _stack(w.scales for w in a),
            _stack(w.scales for w in b), w13_offset=_stack(w.offsets for w in a),
            w2_offset=_stack(w.offsets for w in b), group_size=group, **rest)
    if len(groups) != 1:
        raise ValueError(f"experts in several group sizes {sorted(groups)}")
    group = groups.pop()
    if form in (Fp8Weight, Int8Weight):  # e4m3 or int8 codes, the same scales
        c = [w for w in w13 if isinstance(w, Fp8Weight)]
        d = [w for w in w2 if isinstance(w, Fp8Weight)]
        return ExpertWeights(_stack(w.weight for w in c), _stack(w.weight for w in d), _stack(w.scale for w in c),
                             _stack(w.scale for w in d), group_size=group, **rest)
    raise ValueError(f"experts of form {form.__name__} are not supported (fp8, int8 or 4-bit experts are)")


def _regrouped(w: Int4Weight, group: int) -> Int4Weight:
    """`w` with groups of `group` (a divisor of its own): each scale and offset repeated, exactly."""
    if w.group_size == group:
        return w
    if group % 16:
        raise ValueError(f"4-bit experts in group sizes whose common divisor {group} is not a multiple of 16")
    times = w.group_size // group
    return replace(w, scales=w.scales.repeat_interleave(times, 0), offsets=w.offsets.repeat_interleave(times, 0),
                   group_size=group)


def _stack(parts) -> torch.Tensor:
    return torch.stack(list(parts)).contiguous()


def quantize_experts_fp8(experts: ExpertWeights) -> ExpertWeights:
    """e4m3 experts with per-output-channel scales (kernels/fp8.py's rounding)."""
    w13, w13_scale = quantize_rows(experts.w13)
    w2, w2_scale = quantize_rows(experts.w2)
    return replace(experts, w13=w13.contiguous(), w2=w2.contiguous(), w13_scale=w13_scale.contiguous(),
                   w2_scale=w2_scale.contiguous())


def quantize_experts_int4(experts: ExpertWeights, source_group_size: int | None = None) -> ExpertWeights:
    """4-bit experts, group-wise asymmetric (kernels/int4.py's quantizer), expert by expert; the
    group is `int4_group_size`'s choice for a width dividing both input widths (one group serves
    both projections)."""
    group = int4_group_size(math.gcd(experts.hidden, experts.inter), source_group_size)
    w13 = [quantize_int4(experts.w13[e], group) for e in range(experts.num_experts)]
    w2 = [quantize_int4(experts.w2[e], group) for e in range(experts.num_experts)]
    return stack_experts(w13, w2, w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
                         clamped_swiglu=experts.clamped_swiglu)


def _project(a: torch.Tensor, weight: Projection, bias: torch.Tensor | None) -> torch.Tensor:
    """a @ weight^T in a's dtype (a quantized weight through its reference matmul), then + bias."""
    if isinstance(weight, Int4Weight):
        out = w4a16_matmul_ref(a, weight)
    elif isinstance(weight, Mxfp4Weight):
        out = mxfp4_matmul_ref(a, weight)
    elif isinstance(weight, Fp8Weight):
        out = fp8_matmul_ref(a, weight)
    else:
        out = F.linear(a, weight)
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
    tokens_in_batch, inter, e = x.shape[0], experts.inter, experts
    # (slot, token) pairs, slot-major as transformers walks them: grouped by expert (a stable sort),
    # each expert's rows in its order, which its matmuls' float32 bits follow
    by_slot = topk_ids.t().reshape(-1)
    pairs = by_slot.argsort(stable=True)
    counts = torch.bincount(by_slot, minlength=e.num_experts).tolist()
    weights = topk_weights.t().reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        mine = pairs[start : start + count]
        start += count
        tokens = mine % tokens_in_batch
        gate, up = _project(x[tokens], e.projection("w13", expert), _row(e.w13_bias, expert)).split(inter, dim=-1)
        h = _project(_activate(gate, up, e.clamped_swiglu), e.projection("w2", expert), _row(e.w2_bias, expert))
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


__all__ = ["ExpertWeights", "fused_moe_ref", "quantize_experts_fp8", "quantize_experts_int4", "route", "stack_experts"]
