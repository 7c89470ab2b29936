"""Speculator: which requests draft, their drafts, and the verification of a step's rows.

Row j of a verifying request is the token the sampler draws after its drafts 1..j, and the
request keeps the drafts that equal the row before's token plus one token of its own (the
correction, or the bonus when every draft is accepted). Greedy rows take the first maximum; a
sampled row runs the sampler's exponential race with its own fresh noise, drawn from the
request's generator in row order, so every kept token is the one decoding one step at a time
would draw with the same noise: the output distribution is the target's exactly, and a seeded
request's text is the same with speculation as without (the rejected rows' draws are redrawn
for the tokens that follow). For a draft that is a single proposed token (n-gram), this keeps a
draft with the target's probability of it and otherwise draws from the target without it, which
is what rejection sampling (Leviathan et al.; Chen et al.) does with a one-point proposal.

Every request may draft. A row's logit processors see the request as it would be at that row:
penalties, bad words and min_tokens read its tokens with the drafts before the row (DraftRow),
and a structured output's grammar masks the row in its state after them
(structured_output.draft_masks; n-gram drafts are cut where the grammar refuses one).

The drafts come from the n-gram lookup while the step is scheduled, or from a model of the
proposer's own (a draft model or an EAGLE-3 head: own_cache.py) in one batched pass after it
(`complete`): the scheduler then reserves the rows and blocks for each request's drafts
(placeholders), which the proposer fills before the target runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from ..structured_output import accepted_prefix, allocate_bitmask, draft_masks
from .config import SpeculativeConfig
from .draft_length import DraftLengths, num_kept
from .ngram import propose_ngram

if TYPE_CHECKING:
    from ..sampler import Sampler
    from ..scheduler import ScheduledBatch
    from ..sequence import Sequence
    from .own_cache import OwnCacheProposer

PENDING = -1
"""A draft token the draft model has not proposed yet (between scheduling and `complete`)."""


@dataclass
class SpecStats:
    """Running totals with vLLM v1's meaning (vllm:spec_decode_*)."""

    num_drafts: int = 0
    """Request-steps that verified at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Position i: request-steps that accepted at least i + 1 drafts."""


@dataclass
class Verification:
    """A launched verify: every row's token, each sequence's first row's token, the drafts, each
    row's sequence, and the generator state of each seeded sampled sequence before its rows drew
    (None elsewhere)."""

    tokens: torch.Tensor
    firsts: torch.Tensor
    drafts: list[list[int]]
    rows: list[Sequence]
    generator_states: list[torch.Tensor | None]
    vocab_size: int


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int | None = None, draft: OwnCacheProposer | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        """The draft model or EAGLE-3 head (methods draft_model, eagle3), else None (n-gram)."""
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.lengths = DraftLengths(config.num_speculative_tokens, config.draft_length == "adaptive", draft is not None)
        self._drafting = False
        self._shadowing: set[Sequence] = set()
        """Held-back requests whose shadow draft the draft model proposes in `complete`."""
        self._draft_seconds = 0.0
        """The draft model's seconds in the last step."""
        self._held: dict[Sequence, int] = {}
        """Draft model: each held-back request's steps since its last shadow draft."""

    @staticmethod
    def may_draft(seq: Sequence) -> bool:
        """Whether seq drafts this step if its length allows: it decodes (its one new token known)."""
        return seq.num_uncomputed_tokens == 1 and not seq.num_pending_tokens

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step's query tokens and seconds, for the draft lengths' step cost (the
        target's: the draft model's forwards are timed apart)."""
        self.lengths.observe_step(tokens, seconds - self._draft_seconds)

    def drafts_allowed(self, num_running: int) -> bool:
        """Whether a step with `num_running` requests running drafts at all (`disable_by_batch_size`)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def begin_step(self, running: list[Sequence]) -> None:
        """Before a step's drafts are proposed: each decoding request's draft length for it."""
        self._drafting = True
        self.lengths.begin_step(running, [seq for seq in running if self.may_draft(seq)])

    def propose(self, seq: Sequence, cap: int) -> list[int]:
        """Up to min(cap, the request's draft length) draft tokens after seq's known tokens (with a
        draft model: that many PENDING, which `complete` replaces)."""
        length = self.lengths.length(seq)
        if length == 0 and self.lengths.wants_shadow(seq):  # held back: what it would have drafted, scored later
            if self.draft is None:
                self.lengths.shadow(seq, self._ngram(seq, self.config.num_speculative_tokens))
            elif self.lengths.drafts_could_pay() and self.draft.has_drafted(seq) and self._shadow_due(seq):
                self._shadowing.add(seq)
        k = min(cap, length)
        if k <= 0:
            return []
        return self._ngram(seq, k) if self.draft is None else [PENDING] * k

    SHADOW_EVERY = 16
    """Draft model: a held-back request's shadow draft costs a draft forward over its tokens since
    it last drafted (n-gram's costs a lookup), so it gets one every this many steps held back, only
    where drafts could pay at all, and only once it has drafted (its first would cost its prompt)."""

    def _shadow_due(self, seq: Sequence) -> bool:
        if len(self._held) > 1024:
            self._held = {s: n for s, n in self._held.items() if not s.is_finished}
        steps = self._held.get(seq, 0) + 1
        self._held[seq] = steps % self.SHADOW_EVERY
        return steps == self.SHADOW_EVERY

    def complete(self, batch: ScheduledBatch) -> None:
        """After scheduling, before the target runs: a model proposer's drafts in place of the PENDING ones,
        and a one-token shadow draft for each held-back request due one. Nothing for n-gram, and
        nothing in a step where no request drafts or shadows (a held-back step costs what a plain
        one does; the draft catches up when it next drafts)."""
        drafting, self._drafting = self._drafting, False
        shadowing, self._shadowing = self._shadowing, set()
        self._draft_seconds = 0.0
        if self.draft is None or not (drafting or self.draft.keeps_up):
            return
        counts = {index: len(drafts) for index, drafts in enumerate(batch.drafts) if drafts}
        counts.update({index: 1 for index, seq in enumerate(batch.seqs) if seq in shadowing and index not in counts})
        if not counts and not self.draft.keeps_up:
            return
        proposals = self.draft.propose(batch, counts)
        for num_tokens, seconds in self.draft.forwards:
            self.lengths.observe_draft(num_tokens, seconds)
            self._draft_seconds += seconds
        for index, proposal in proposals.items():
            if batch.drafts[index]:
                batch.drafts[index][:] = proposal
            else:
                self.lengths.shadow(batch.seqs[index], proposal)

    def observe_target(self, batch: ScheduledBatch, aux_hidden: torch.Tensor | None) -> None:
        """The target's step ran: an EAGLE-3 head takes its hidden states (nothing for the others)."""
        if self.draft is not None and self.draft.keeps_up:
            self.draft.observe(batch, aux_hidden)

    def _ngram(self, seq: Sequence, k: int) -> list[int]:
        """Up to k n-gram drafts, cut before the first one a structured output's grammar refuses."""
        c = self.config
        drafts = propose_ngram(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k, self.max_model_len)
        if drafts and seq.grammar is not None:
            drafts = drafts[: accepted_prefix(seq.grammar, drafts)]
        return drafts

    @staticmethod
    def verify(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], sampler: Sampler) -> Verification:
        """logits: 1 + len(drafts[i]) rows per sequence, in order. Every row's token through the
        sampler (a sequence's rows share its parameters), noting each seeded sampled request's
        generator before its rows draw."""
        rows = [DraftRow.of(seq, draft[:j]) for seq, draft in zip(seqs, drafts) for j in range(1 + len(draft))]
        states = [seq.generator.get_state() if draft and seq.generator is not None and not seq.params.greedy else None
                  for seq, draft in zip(seqs, drafts)]
        tokens = sampler.sample(logits, rows, _grammar_masks(seqs, drafts, len(rows), logits.shape[-1]))
        offsets, first = 0, []
        for draft in drafts:
            first.append(offsets)
            offsets += 1 + len(draft)
        firsts = tokens.index_select(0, torch.tensor(first, dtype=torch.int64, device=tokens.device))
        return Verification(tokens, firsts, drafts, rows, states, logits.shape[-1])

    def accept(self, row_tokens: list[int], drafts: list[list[int]], seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's tokens for this step: its accepted drafts and one token of the model's."""
        emitted, offset = [], 0
        stats = self.stats
        for seq, draft in zip(seqs, drafts):
            rows = row_tokens[offset : offset + 1 + len(draft)]
            offset += 1 + len(draft)
            m = num_kept(draft, rows)
            emitted.append(rows[: m + 1])
            if draft:
                self.lengths.verified(seq, len(draft), m)
                stats.num_drafts += 1
                stats.num_draft_tokens += len(draft)
                stats.num_accepted_tokens += m
                for position in range(m):
                    stats.accepted_per_pos[position] += 1
        return emitted


class DraftRow:
    """A verify row as the sampler's processors see its request: its tokens followed by the
    drafts before the row (its parameters, generator and grammar are the request's own)."""

    def __init__(self, seq: Sequence, drafted: list[int]):
        self.seq = seq
        self.params = seq.params
        self.generator = seq.generator
        self.grammar = seq.grammar
        self.token_ids = seq.token_ids + drafted

    @staticmethod
    def of(seq: Sequence, drafted: list[int]) -> Sequence:
        """seq itself for its first row or where no processor reads its tokens, else a DraftRow."""
        p = seq.params
        if not drafted or not (p.needs_penalties or p.bad_words_ids or p.min_tokens > seq.num_output_tokens):
            return seq
        return cast("Sequence", DraftRow(seq, drafted))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.seq.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.seq.num_prompt_tokens :]


def _grammar_masks(seqs: list[Sequence], drafts: list[list[int]], num_rows: int, vocab: int) -> torch.Tensor | None:
    """The structured outputs' row masks of a verify (each row the grammar's state after its
    request's drafts before it), None when no request of the step has a grammar."""
    if all(seq.grammar is None for seq in seqs):
        return None
    bitmask, row = allocate_bitmask(num_rows, vocab), 0
    for seq, draft in zip(seqs, drafts):
        if seq.grammar is not None:
            draft_masks(seq.grammar, draft, bitmask, row)
        row += 1 + len(draft)
    return bitmask
