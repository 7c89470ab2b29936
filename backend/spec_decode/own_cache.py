"""What the proposers with a model of their own (a draft model, an EAGLE-3 head) share: a paged K/V
cache over the target's block ids (one block manager allocates, rolls back, preempts and frees for
both; the KV budget pays both models' bytes per block), and stand-ins for requests in its forwards."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..device import kv_block_bytes
from ..model_config import ModelConfig
from ..model_runner import ModelRunner
from ..sampling_params import SamplingParams
from ..sequence import Sequence

if TYPE_CHECKING:
    from ..scheduler import ScheduledBatch

logger = logging.getLogger("pagedserve")


class OwnCacheProposer:
    """The interface `Speculator` drives, and the cache every such proposer keeps."""

    keeps_up = False
    """Whether it reads every target step (its hidden states, `observe`) and runs every step, drafting
    or not; else it runs only when a request drafts."""

    def __init__(self, model: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention_backend: str, path: str):
        self.model = model
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention_backend = attention_backend
        self.path = path
        self.runner: ModelRunner | None = None
        self.forwards: list[tuple[int, float]] = []
        """The last `propose`'s forwards: (tokens, seconds) each, for the draft lengths' cost."""

    def block_bytes(self, block_size: int) -> int:
        """What one KV block costs in this proposer's cache."""
        return kv_block_bytes(self.config, block_size, self.dtype)

    def fit_context(self, max_model_len: int, asked: int) -> int:
        """The engine's max_model_len as this proposer allows it (unchanged unless it has a shorter context)."""
        return max_model_len

    def start(self, num_blocks: int, block_size: int, graph_max_seqs: int = 0, max_model_len: int = 0) -> None:
        """Allocate the cache: the target's block count, the target's block size; graph_max_seqs > 0
        (CUDA): forwards of one token a request, up to that many requests, replay decode graphs
        captured now for contexts up to max_model_len."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.dtype, self.device, self.attention_backend,
                                  0, graph_max_seqs, max_model_len)
        try:
            self.runner.capture_graphs()
        except Exception as error:  # noqa: BLE001 - eager drafts are the same drafts, only slower
            logger.warning("the draft's forwards run eager: its CUDA graphs did not capture (%s: %s)",
                           type(error).__name__, error)
            self.runner.graphs = None

    def observe(self, batch: ScheduledBatch, aux: torch.Tensor | None) -> None:
        """The target's step ran (`aux`: its kept hidden states); nothing by default."""

    def has_drafted(self, seq: Sequence) -> bool:
        """Whether seq's K/V are in the cache: a shadow draft then costs its tokens since, not its prompt."""
        raise NotImplementedError

    def propose(self, batch: ScheduledBatch, counts: dict[int, int]) -> dict[int, list[int]]:
        """Drafts for the batch's sequences at the indices `counts` names (that many each)."""
        raise NotImplementedError

    def _step(self, views: list[Sequence]) -> ScheduledBatch:
        """The views as one step of this proposer's own: each computes its tokens past `computed`,
        committed as the scheduler commits a step (so one token each is a decode a graph takes)."""
        from ..scheduler import ScheduledBatch

        step = ScheduledBatch()
        for view in views:
            step.add(view, view.num_tokens - view.num_computed_tokens)
        step.starts = [view.num_computed_tokens for view in views]
        step.samples = [True] * len(views)
        step.sampling_seqs = list(views)
        return step


def view(seq: Sequence, token_ids: list[int], computed: int) -> Sequence:
    """A stand-in for seq in a proposer's forward: these tokens, the first `computed` of them in its
    cache, seq's block table."""
    stand_in = Sequence(seq.request_id, token_ids, _PLAIN)
    stand_in.block_table = seq.block_table
    stand_in.num_computed_tokens = computed
    return stand_in


_PLAIN = SamplingParams()
