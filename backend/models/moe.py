"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's experts, and the
experts' MLPs run as one fused call (kernels/dispatch.py's `fused_moe`).

The experts' weights are held stacked, as the fused kernels read them: `w13` [experts, 2 * inter,
hidden] (each expert's gate rows, then its up rows) and `w2` [experts, hidden, inter]. The loader
hands each checkpoint tensor (experts.E.gate_proj / up_proj / down_proj) to `load_expert`.
Tensor parallelism splits every expert's intermediate width over the ranks, as the dense MLP's:
gate / up rows and down columns, then the ranks' partial sums are all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.dispatch import fused_moe
from pagedserve.kernels.moe import ExpertWeights, quantize_experts_fp8, route

from ..errors import ConfigError
from ..model_config import ModelConfig
from .linear import Linear
from .parallel import Shard, TensorParallel

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class SparseMoeBlock(nn.Module):
    """A layer's router (`gate`, replicated on every rank) and its experts (this rank's share)."""

    def __init__(self, config: ModelConfig, parallel: TensorParallel):
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        inter = config.expert_intermediate_size // parallel.size
        self.gate = Linear(hidden, experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        """Each output channel's scale once the experts are e4m3 (`quantize_fp8`)."""
        self.top_k = config.experts_per_token
        self.renormalize, self.rounded = config.renormalize_expert_weights, config.expert_weights_rounded
        self.shard, self.collectives = parallel.shard(0), parallel.collectives
        """This rank's rows of gate / up (its columns of down: the same slice along dim 1)."""
        self.loaded: set[tuple[int, str]] = set()
        """The (expert, projection) tensors the loader has copied in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.rounded)
        out = fused_moe(x, self.experts, weights, ids)
        return out if self.collectives is None else self.collectives.all_reduce(out)

    @property
    def experts(self) -> ExpertWeights:
        return ExpertWeights(self.w13, self.w2, self.w13_scale, self.w2_scale)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """The experts in e4m3 with per-channel scales (quantization fp8): half their bytes."""
        q = quantize_experts_fp8(self.experts)
        assert q.w13_scale is not None and q.w2_scale is not None  # e4m3 experts carry both
        self.w13, self.w2 = nn.Parameter(q.w13, requires_grad=False), nn.Parameter(q.w2, requires_grad=False)
        self.w13_scale = nn.Parameter(q.w13_scale, requires_grad=False)
        self.w2_scale = nn.Parameter(q.w2_scale, requires_grad=False)

    @torch.no_grad()
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor experts.<expert>.<projection>.weight (the whole of it; this rank's
        slice is taken here) into the stacked weights."""
        experts, hidden, inter = self.w2.shape
        if not 0 <= expert < experts or projection not in EXPERT_PROJECTIONS:
            raise ConfigError("model", f"checkpoint tensor experts.{expert}.{projection} does not fit a layer of "
                                       f"{experts} experts")
        down = projection == "down_proj"
        full = (hidden, inter * self.shard.count) if down else (inter * self.shard.count, hidden)
        if tuple(tensor.shape) != full:
            raise ConfigError("model", f"checkpoint tensor experts.{expert}.{projection}.weight has shape "
                                       f"{tuple(tensor.shape)}, expected {full}")
        if down:
            self.w2[expert].copy_(Shard(1, self.shard.index, self.shard.count).take(tensor))
        else:
            rows = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
            self.w13[expert, rows].copy_(self.shard.take(tensor))
        self.loaded.add((expert, projection))

    def missing(self) -> list[str]:
        """The expert tensors the checkpoint has not given (empty once loaded)."""
        return [f"experts.{e}.{p}" for e in range(self.w13.shape[0]) for p in EXPERT_PROJECTIONS
                if (e, p) not in self.loaded]
