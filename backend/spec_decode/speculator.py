"""Speculator: which requests draft, their drafts, and the verification of a step's rows.

Slice 1 is greedy-exact: only plain greedy requests (no penalties, bad words, structured
output or pending min_tokens, whose logit processors would need per-row histories holding
the drafts) get drafts; row j of a verified request is the greedy token after its draft
tokens 1..j, and the request keeps the drafts that equal the row before's token plus one
token of the model's own (the correction, or the bonus when every draft is accepted), so its
tokens are exactly those of decoding one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .config import SpeculativeConfig
from .ngram import propose_ngram

if TYPE_CHECKING:
    from ..sampler import Sampler
    from ..sequence import Sequence


@dataclass
class SpecStats:
    """Running totals with vLLM v1's meaning (vllm:spec_decode_*)."""

    num_drafts: int = 0
    """Request-steps that verified at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Position i: request-steps that accepted at least i + 1 drafts."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return (p.greedy and not p.needs_penalties and not p.bad_words_ids and p.structured_outputs is None
                and seq.grammar is None and seq.num_output_tokens >= p.min_tokens)

    def drafts_allowed(self, num_running: int) -> bool:
        """Whether a step with `num_running` requests running drafts at all (`disable_by_batch_size`)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, seq: Sequence, cap: int) -> list[int]:
        """Up to min(cap, num_speculative_tokens) draft tokens after seq's known tokens."""
        k = min(cap, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        c = self.config
        return propose_ngram(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k, self.max_model_len)

    @staticmethod
    def verify(
        logits: torch.Tensor, seqs: list[Sequence], counts: list[int], sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: counts[i] rows per sequence, in order. Returns every row's token (greedy, the
        same first-max rule as the sampler's; each sequence's first row through the sampler, as a
        plain step samples it) and the first rows' tokens alone."""
        from ..sampler import first_max_index

        offsets, first = 0, []
        for count in counts:
            first.append(offsets)
            offsets += count
        index = torch.tensor(first, dtype=torch.int64, device=logits.device)
        base = sampler.sample(logits.index_select(0, index), seqs)
        rows = first_max_index(logits).clone()
        rows[index] = base
        return rows, base

    def accept(self, row_tokens: list[int], drafts: list[list[int]]) -> list[list[int]]:
        """Each sequence's tokens for this step: its accepted drafts and one token of the model's."""
        emitted, offset = [], 0
        stats = self.stats
        for draft in drafts:
            rows = row_tokens[offset : offset + 1 + len(draft)]
            offset += 1 + len(draft)
            m = 0
            while m < len(draft) and rows[m] == draft[m]:
                m += 1
            emitted.append(rows[: m + 1])
            if draft:
                stats.num_drafts += 1
                stats.num_draft_tokens += len(draft)
                stats.num_accepted_tokens += m
                for position in range(m):
                    stats.accepted_per_pos[position] += 1
        return emitted
