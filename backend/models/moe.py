"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks each token's experts, and
the experts' MLPs run as one fused call (kernels/dispatch.py's `fused_moe`).

The experts' weights are held stacked, as the fused kernels read them: `w13` [experts, 2 * inter,
hidden] (each expert's gate rows, then its up rows) and `w2` [experts, hidden, inter], with gpt-oss's
biases `w13_bias` / `w2_bias` beside; quantized (fp8 or int4 on load; fp8, int8, int4 from a
quantized checkpoint; gpt-oss's MXFP4) in kernels/moe.py's layouts of those forms. The loader hands each checkpoint tensor
(experts.E.gate_proj / up_proj / down_proj, .weight or .bias) to `load_expert`; a quantized
checkpoint's experts are read by checkpoints/prequantized.py and stacked in by `install`.
Tensor parallelism splits every expert's intermediate width over the ranks, as the dense MLP's:
gate / up rows and down columns, then the ranks' partial sums are all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.dispatch import fused_moe
from pagedserve.kernels.moe import ExpertWeights, quantize_experts_fp8, quantize_experts_int4, route
from pagedserve.kernels.mxfp4 import BLOCK as MXFP4_BLOCK

from ..errors import ConfigError
from ..model_config import ModelConfig
from .linear import Linear
from .parallel import Shard, TensorParallel

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_INPUTS_PER_COLUMN = {"weight_blocks": 2, "weight_scales": MXFP4_BLOCK}
"""How many inputs one column of an MXFP4 expert tensor holds (gpt-oss's codes two a byte, scales a block)."""


class SparseMoeBlock(nn.Module):
    """A layer's router (`gate`, replicated on every rank) and its experts (this rank's share)."""

    def __init__(self, config: ModelConfig, parallel: TensorParallel):
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        inter = config.expert_intermediate_size // parallel.size
        self.num_experts, self.hidden, self.inter = experts, hidden, inter
        self.gate = Linear(hidden, experts, bias=config.router_bias)
        self.prequantized = bool(config.packed_weights)
        """A quantized checkpoint's experts arrive whole, already stacked (`install`): no dense ones."""
        dense = not self.prequantized
        self.w13 = nn.Parameter(torch.empty((experts, 2 * inter, hidden) if dense else (0,)))
        self.w2 = nn.Parameter(torch.empty((experts, hidden, inter) if dense else (0,)))
        self.w13_bias = nn.Parameter(torch.empty(experts, 2 * inter)) if config.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(experts, hidden)) if config.expert_bias else None
        self.clamped_swiglu = config.clamped_swiglu
        self.softmax_after_topk = config.softmax_after_topk
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.w13_offset: nn.Parameter | None = None
        self.w2_offset: nn.Parameter | None = None
        self.group_size = 0
        """Quantized experts' scales (and int4 offsets, group): kernels/moe.py's layouts."""
        if config.mxfp4_experts:
            self._hold_mxfp4(parallel.size)
        self.top_k = config.experts_per_token
        self.renormalize, self.rounded = config.renormalize_expert_weights, config.expert_weights_rounded
        self.shard, self.collectives = parallel.shard(0), parallel.collectives
        """This rank's rows of gate / up (its columns of down: the same slice along dim 1)."""
        self.loaded: set[tuple[int, str]] = set()
        """The (expert, projection) tensors the loader has copied in."""
        self.batch_invariant = False
        """`deterministic` on a GPU (backend/batch_invariant.py): the fused kernels' batch-invariant launch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.rounded, self.softmax_after_topk)
        out = fused_moe(x, self.experts, weights, ids, self.batch_invariant)
        return out if self.collectives is None else self.collectives.all_reduce(out)

    @property
    def experts(self) -> ExpertWeights:
        return ExpertWeights(self.w13, self.w2, self.w13_scale, self.w2_scale, self.w13_bias, self.w2_bias,
                             self.clamped_swiglu, self.w13_offset, self.w2_offset, self.group_size)

    def _hold_mxfp4(self, ranks: int) -> None:
        """Room for MXFP4 experts (gpt-oss's release, loaded as its codes and scales): uint8 codes, two
        a byte along K, and an e8m0 scale per 32 inputs (kernels/moe.py's mxfp4 form)."""
        experts, hidden, inter = self.num_experts, self.hidden, self.inter
        if hidden % MXFP4_BLOCK or inter % MXFP4_BLOCK:
            raise ConfigError("tensor_parallel_size", f"MXFP4 experts of widths {hidden} and {inter} (per rank, over "
                                                      f"{ranks}) are not whole {MXFP4_BLOCK}-input blocks")

        def codes(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        self.w13, self.w2 = codes(experts, 2 * inter, hidden // 2), codes(experts, hidden, inter // 2)
        self.w13_scale = codes(experts, 2 * inter, hidden // MXFP4_BLOCK)
        self.w2_scale = codes(experts, hidden, inter // MXFP4_BLOCK)
        self.group_size = MXFP4_BLOCK

    @torch.no_grad()
    def quantize(self, method: str, source_group_size: int | None = None) -> None:
        """The experts in e4m3 with per-channel scales (method fp8: half their bytes) or 4-bit
        group-wise (int4: a quarter), quantized from the loaded weights; MXFP4 experts stay as they
        are (4 bits already)."""
        if self.experts.form == "mxfp4":
            return
        if method == "fp8":
            self.install(quantize_experts_fp8(self.experts))
        elif method == "int4":
            try:
                self.install(quantize_experts_int4(self.experts, source_group_size))
            except ValueError as error:
                raise ConfigError("quantization", f"int4 experts: {error}") from None
        else:
            raise ValueError(f"unknown quantization {method!r}")

    def install(self, experts: ExpertWeights) -> None:
        """Hold `experts` (quantized on load, or a quantized checkpoint's, stacked) in place of the
        loaded ones; biases and the activation stay the layer's."""
        def frozen(t: torch.Tensor | None) -> nn.Parameter | None:
            return None if t is None else nn.Parameter(t, requires_grad=False)

        self.w13, self.w2 = nn.Parameter(experts.w13, requires_grad=False), nn.Parameter(experts.w2, requires_grad=False)
        self.w13_scale, self.w2_scale = frozen(experts.w13_scale), frozen(experts.w2_scale)
        self.w13_offset, self.w2_offset = frozen(experts.w13_offset), frozen(experts.w2_offset)
        self.group_size = experts.group_size

    @torch.no_grad()
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Copy checkpoint tensor experts.<expert>.<projection>.<kind> (weight, or bias where the experts
        have biases; the whole of it: this rank's slice is taken here) into the stacked tensors."""
        experts, hidden, inter = self.num_experts, self.hidden, self.inter
        if not 0 <= expert < experts or projection not in EXPERT_PROJECTIONS or kind not in self._kinds():
            held = "quantized experts (the checkpoint's own quantized tensors, not dense ones)" if self.prequantized \
                else f"{self.experts.form} experts"
            raise ConfigError("model", f"checkpoint tensor experts.{expert}.{projection}.{kind} does not fit a layer "
                                       f"of {experts} {held}{'' if self.w13_bias is not None else ' without biases'}")
        down = projection == "down_proj"
        per = _INPUTS_PER_COLUMN.get(kind, 1)
        full: tuple[int, ...] = (hidden, inter * self.shard.count // per) if down else (inter * self.shard.count, hidden // per)
        full = full[:1] if kind == "bias" else full
        if tuple(tensor.shape) != full:
            raise ConfigError("model", f"checkpoint tensor experts.{expert}.{projection}.{kind} has shape "
                                       f"{tuple(tensor.shape)}, expected {full}")
        stacked = {("weight", False): self.w13, ("weight", True): self.w2, ("bias", False): self.w13_bias,
                   ("bias", True): self.w2_bias, ("weight_blocks", False): self.w13, ("weight_blocks", True): self.w2,
                   ("weight_scales", False): self.w13_scale, ("weight_scales", True): self.w2_scale}[(kind, down)]
        assert stacked is not None  # biases are in _kinds() only where the layer has them
        if down and kind == "bias":  # of the all-reduced sum: rank 0 adds it, the others zeros
            stacked[expert].copy_(tensor if self.shard.index == 0 else torch.zeros_like(tensor))
        elif down:
            stacked[expert].copy_(Shard(1, self.shard.index, self.shard.count).take(tensor))
        else:
            rows = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
            stacked[expert, rows].copy_(self.shard.take(tensor))
        self.loaded.add((expert, f"{projection}.{kind}"))

    def takes(self, kind: str) -> bool:
        """Whether `load_expert` takes checkpoint tensors of this kind (weight, bias, ...)."""
        return kind in self._kinds()

    def _kinds(self) -> tuple[str, ...]:
        """What load_expert takes: weights (MXFP4: codes and scales) and biases; a quantized
        checkpoint's experts' biases alone (their weights come through `install`)."""
        mxfp4 = self.w13.dtype == torch.uint8
        weights = ("weight_blocks", "weight_scales") if mxfp4 else () if self.prequantized else ("weight",)
        return weights + (("bias",) if self.w13_bias is not None else ())

    def missing(self) -> list[str]:
        """The expert tensors the checkpoint has not given (empty once loaded)."""
        return [f"experts.{e}.{p}.{k}" for e in range(self.num_experts) for p in EXPERT_PROJECTIONS
                for k in self._kinds() if (e, f"{p}.{k}") not in self.loaded]
