"""Tensor-parallel (Megatron-style) layers: each rank holds a slice of a layer's weight,
and ranks meet through a collective only where a slice's result is partial.

- column-parallel (q/k/v, gate/up): a rank holds some output rows, so its outputs are
  complete for its own heads / intermediate channels; no communication.
- row-parallel (o_proj, down_proj): a rank holds the matching input columns, so its
  output is a partial sum: all-reduced. Its bias is added once: rank 0 holds it, the
  others a bias of zeros (`take_shard`), so every rank's layer is the same Linear.
- vocabulary-parallel embedding: a rank holds some vocabulary rows; tokens outside
  them get zeros and the all-reduce fills them in (exact: x + 0 = x).
- vocabulary-parallel LM head: each rank's logits of its vocabulary rows, all-gathered,
  so every rank holds the full logits.

With one rank these are the plain layers and no collective is called. Weights are
cut while loading: a layer lists one Shard per checkpoint tensor stacked into it,
and model_loader.load_weights takes that slice of each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.mxfp4 import BLOCK as MXFP4_BLOCK

from ..errors import ConfigError
from ..model_config import ModelConfig
from .linear import Linear


class Collectives(Protocol):
    """What a sharded layer needs from the process group (backend/distributed/group.py)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along the last dimension, in rank order."""


@dataclass(frozen=True)
class Shard:
    """Slice `index` of `count` equal slices of a checkpoint tensor along `dim`; a tensor
    with fewer dimensions (the bias of a row-parallel layer) is kept whole."""

    dim: int
    index: int = 0
    count: int = 1

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.count == 1 or tensor.dim() <= self.dim:
            return tensor
        size = tensor.shape[self.dim] // self.count
        return tensor.narrow(self.dim, self.index * size, size)


@dataclass
class TensorParallel:
    """One rank's place in a tensor-parallel group: which slices it holds and how it
    reaches the other ranks (None with a single rank)."""

    rank: int = 0
    size: int = 1
    collectives: Collectives | None = None

    def shard(self, dim: int) -> Shard:
        return Shard(dim, self.rank, self.size)

    def kv_shard(self, num_kv_heads: int) -> Shard:
        """KV heads split over the ranks; with fewer KV heads than ranks, each rank keeps a
        copy of the one KV head its query heads read (replicated)."""
        if num_kv_heads >= self.size:
            return self.shard(0)
        return Shard(0, self.rank * num_kv_heads // self.size, num_kv_heads)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The architecture numbers of this rank's share (heads, KV heads, intermediate
        size, vocabulary); ConfigError when the model does not split `size` ways."""
        check_tensor_parallel(config, self.size)
        if self.size == 1:
            return config
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=max(1, config.num_kv_heads // self.size),
            intermediate_size=config.intermediate_size // self.size,
            vocab_size=config.vocab_size // self.size,
        )


SINGLE_RANK = TensorParallel()


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ConfigError naming `tensor_parallel_size` and the sizes this model allows."""
    if size == 1:
        return
    if config.packed_weights:
        raise ConfigError(
            "tensor_parallel_size",
            f"{config.packed_weights} checkpoints are not sharded; serve them with tensor_parallel_size=1 "
            "or use the bf16/fp32 checkpoint",
        )
    if config.qk_norm_across_heads:
        raise ConfigError(
            "tensor_parallel_size",
            "this model's query / key norms span every head (OLMo 2), so a rank holding some heads "
            "cannot norm them alone; serve it with tensor_parallel_size=1",
        )
    problems = _split_problems(config, size)
    if problems:
        allowed = [n for n in range(1, 65) if not _split_problems(config, n)]
        raise ConfigError(
            "tensor_parallel_size",
            f"{size} ranks cannot split the model: {'; '.join(problems)}; use one of {allowed}",
        )


def _split_problems(config: ModelConfig, size: int) -> list[str]:
    kv, problems = config.num_kv_heads, []
    for what, count in (("attention heads", config.num_heads), ("intermediate size", config.intermediate_size),
                        ("vocabulary size", config.vocab_size), ("experts' intermediate size", config.expert_intermediate_size)):
        if count % size:
            problems.append(f"{count} {what} is not a multiple of {size}")
    if kv % size and size % kv:
        problems.append(f"{kv} KV heads and {size} ranks: one must be a multiple of the other")
    if config.mxfp4_experts and config.expert_intermediate_size % (MXFP4_BLOCK * size):
        problems.append(f"the experts' intermediate size {config.expert_intermediate_size} does not split into whole "
                        f"{MXFP4_BLOCK}-input MXFP4 blocks over {size} ranks")
    return problems


class ColumnParallelLinear(Linear):
    """A Linear holding this rank's output rows of each stacked checkpoint tensor
    (`shards`, one per tensor, in stacking order)."""

    def __init__(self, in_features: int, out_features: int, shards: tuple[Shard, ...], bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.shards = shards


class CombiningLinear(Linear):
    """A Linear holding this rank's slice along `shard_dim` of the checkpoint weight, whose
    partial outputs the ranks combine (`combine`) into the full result."""

    shard_dim: int

    def __init__(self, in_features: int, out_features: int, parallel: TensorParallel, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.shards = (parallel.shard(self.shard_dim),)
        self.collectives = parallel.collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.collectives is None else self.combine(out, self.collectives)

    def combine(self, out: torch.Tensor, collectives: Collectives) -> torch.Tensor:
        raise NotImplementedError


class RowParallelLinear(CombiningLinear):
    """This rank's input columns: its outputs are partial sums, all-reduced (the bias rank 0's)."""

    shard_dim = 1
    bias_on_first_rank_only = True

    def combine(self, out: torch.Tensor, collectives: Collectives) -> torch.Tensor:
        return collectives.all_reduce(out)


class ParallelLMHead(CombiningLinear):
    """This rank's vocabulary rows: its logits, gathered from every rank into the full vocabulary."""

    shard_dim = 0

    def combine(self, out: torch.Tensor, collectives: Collectives) -> torch.Tensor:
        return collectives.all_gather(out)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocabulary rows; other tokens embed to zeros here and are filled in
    by the other ranks' rows in the all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: TensorParallel):
        super().__init__(num_embeddings, embedding_dim)
        self.shards = (parallel.shard(0),)
        self.start = parallel.rank * num_embeddings
        self.collectives = parallel.collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.collectives is None:
            return super().forward(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.collectives.all_reduce(out)


def take_shard(module: nn.Module, index: int, tensor: torch.Tensor, kind: str = "weight") -> torch.Tensor:
    """This rank's slice of the `index`-th checkpoint tensor stacked into `module`
    (the whole tensor for layers that are not split: norms); a row-parallel layer's bias
    on rank 0 only (zeros elsewhere: the all-reduce adds it once)."""
    shards = getattr(module, "shards", None)
    if shards is None:
        return tensor
    if kind == "bias" and getattr(module, "bias_on_first_rank_only", False) and shards[index].index != 0:
        return torch.zeros_like(tensor)
    return shards[index].take(tensor)
