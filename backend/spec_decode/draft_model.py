"""The draft-model proposer: a smaller model of the target's tokenizer drafts greedily.

Its K/V live in a paged cache of its own indexed by the target's block ids: a block the scheduler
gives a request holds the target's K/V in the target's cache and the draft's in this one, so the
one block manager allocates, rolls back, frees and preempts for both, and the one KV budget pays
for both (each block costs the two models' bytes: `block_bytes`).

The draft catches up when a request drafts: before the target runs, one draft forward takes
each drafting request's tokens not yet in the draft's cache (its whole prompt the first time,
what the prefix cache gave it included: those blocks may hold another request's target K/V
without its draft's; afterwards the one or two tokens since its last drafts), then one forward
per further draft position. A request that never drafts (held back, or with a logit processor)
costs the draft nothing. A request's draft K/V count as valid only up to the tokens the target
has kept: a slot written from a rejected draft lies past them and is written again, and a
preempted request starts over.

Greedy drafting proposes one token per position (a point proposal), which the speculator's
verification keeps with the target's probability of it, so sampled requests keep the target's
distribution exactly (speculator.py). A draft sampled from its own distribution would be
accepted more often under sampling, at the price of a rejection sampler that reads both
models' probabilities; not built.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..device import DTYPES
from ..errors import ConfigError
from ..model_config import ModelConfig
from ..model_loader import load_model
from ..models.parallel import SINGLE_RANK
from ..sequence import Sequence
from .config import FIELD, SpeculativeConfig
from .own_cache import OwnCacheProposer, view

if TYPE_CHECKING:
    from ..cpu.backend import CpuBackend
    from ..scheduler import ScheduledBatch


@dataclass
class _Kept:
    """How many leading tokens of a request have their draft K/V in the cache, as of which preemption."""

    valid: int
    preemptions: int


class DraftModel(OwnCacheProposer):
    """A smaller model of the target's tokenizer; it catches up when a request drafts (its cache
    can be recomputed from the tokens)."""

    def __init__(self, model: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 attention_backend: str, target_vocab_size: int, path: str):
        super().__init__(model, config, dtype, device, attention_backend, path)
        self.vocab_size = min(config.vocab_size, target_vocab_size)
        """Drafts come from the ids both models have (embeddings are often padded differently)."""
        self._kept: dict[Sequence, _Kept] = {}

    def fit_context(self, max_model_len: int, asked: int) -> int:
        """The engine's max_model_len within the draft's context too: the automatic one shrinks to
        it, an asked-for one beyond it is refused."""
        context = self.config.max_position_embeddings
        if max_model_len <= context:
            return max_model_len
        if asked:
            raise ConfigError("max_model_len", f"{asked} is beyond the draft model's context ({context} tokens, "
                                               f"{self.path}); lower it to {context} or less")
        return context

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, counts: dict[int, int]) -> dict[int, list[int]]:
        """Drafts for the batch's sequences at the indices `counts` names (that many each): one pass
        over each one's tokens not yet in the draft's cache, then one per further position."""
        runner = self.runner
        assert runner is not None, "start() allocates the draft's cache first"
        self.forwards = []
        if len(self._kept) > 4 * max(len(batch.seqs), 16):
            self._kept = {seq: kept for seq, kept in self._kept.items() if not seq.is_finished}
        views, indices, ends = [], [], []
        for index, seq in enumerate(batch.seqs):
            if index not in counts:
                continue
            start = batch.starts[index]
            end = start + batch.num_new_tokens[index] - len(batch.drafts[index])  # its real tokens this step
            views.append(view(seq, seq.token_ids[:end], self._valid(seq, start)))
            indices.append(index)
            ends.append(end)
            self._kept[seq] = _Kept(end, seq.num_preemptions)
        if not views:
            return {}
        drafts = {index: [token] for index, token in zip(indices, self._forward(views))}
        last = dict(zip(indices, ends))
        for position in range(1, max(counts.values(), default=0)):
            going = [index for index in drafts if counts[index] > position]
            if not going:
                break
            seqs = [batch.seqs[index] for index in going]
            views = [view(seq, seq.token_ids[: last[index]] + drafts[index], last[index] - 1 + position)
                     for seq, index in zip(seqs, going)]
            for token, index, seq in zip(self._forward(views), going, seqs):
                drafts[index].append(token)
                self._kept[seq].valid = last[index] + position
        return drafts

    def has_drafted(self, seq: Sequence) -> bool:
        """Whether seq's draft K/V are in the cache (it drafted since it last started)."""
        kept = self._kept.get(seq)
        return kept is not None and kept.preemptions == seq.num_preemptions

    def _valid(self, seq: Sequence, start: int) -> int:
        """Leading tokens of seq whose draft K/V stand: at most what the target has kept (`start`)."""
        return min(self._kept[seq].valid, start) if self.has_drafted(seq) else 0

    def _forward(self, views: list[Sequence]) -> list[int]:
        """One draft forward over the views' uncomputed tokens; the greedy next token of each."""
        runner = self.runner
        assert runner is not None
        started = time.perf_counter()
        step = self._step(views)
        logits, order = runner.execute(step)  # a decode graph's rows keep their own order
        tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        self.forwards.append((step.num_tokens, time.perf_counter() - started))
        row = {id(seq): index for index, seq in enumerate(order)}
        return [tokens[row[id(view)]] for view in views]


def load_draft(spec: SpeculativeConfig, target: ModelConfig, target_tokenizer: Any, target_path: str,
               target_dtype: torch.dtype, device: torch.device, attention_backend: str,
               cpu: CpuBackend | None, load_format: str = "auto") -> DraftModel:
    """The draft model of `speculative_config`, checked against the target: a checkpoint that
    exists, a text model, the target's tokenizer (token ids mean the same words in both)."""
    from ..model_loader import read_checkpoint
    from ..tokenizer import load_tokenizer

    path = spec.model
    if not os.path.exists(path):
        raise ConfigError(FIELD, f"model {path!r}: no such file or directory (the draft's Hugging Face directory or "
                                 ".gguf file)")
    if target.vision_language:
        raise ConfigError(FIELD, "method 'draft_model' is for text models; a draft cannot see the target's images "
                                 "(use method 'ngram')")
    config = read_checkpoint(path, load_format).config
    if config.vision_language:
        raise ConfigError(FIELD, f"model {path!r} is a vision-language model; a draft must be a text model")
    tokenizer = load_tokenizer(path)
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ConfigError(FIELD, f"the draft {path} has another tokenizer ({len(tokenizer)} tokens) than the target "
                                 f"{target_path} ({len(target_tokenizer)} tokens); a draft must share the target's "
                                 "vocabulary")
    dtype = target_dtype if spec.dtype == "auto" else DTYPES[spec.dtype]
    keep = cpu.checkpoint_hook(dtype, False, False) if cpu is not None else None
    loaded = load_model(path, dtype, device, SINGLE_RANK, load_format, keep)
    if cpu is not None:
        cpu.prepare(loaded.model, loaded.config, dtype, False)
    return DraftModel(loaded.model, loaded.config, dtype, device, attention_backend, target.vocab_size, path)
