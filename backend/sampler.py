"""Sampler: the next token of each sequence, each with its own parameters.

Order: logit processors (penalties, min_tokens, bad words) on the raw logits,
then greedy argmax, or temperature, top-k, top-p, min-p and a draw. A draw is
an exponential race (argmax of p / Exp(1)), which equals sampling from p and
lets a per-request generator make a request reproducible whatever its batch.
Logprobs are those of the model's raw distribution.

A structured output's grammar masks its row's logits before top-k, top-p and min-p
(those keep the most likely tokens of what the grammar allows). A row with none of the
three is masked only when its draw breaks the grammar: the race's winner, where the
grammar allows it, is also the winner among the allowed tokens alone, so masking first
would have chosen it too; otherwise the row is masked and raced again with the same noise.
A model that follows its grammar then rarely pays for the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import dispatch

from .sampling_params import SamplingParams
from .sequence import Sequence, TokenLogprob
from .structured_output import allows, apply_bitmask, bitmask_allows, mask_logits


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device, batch_invariant: bool = False):
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.batch_invariant = batch_invariant
        """`deterministic` on a GPU: logprobs from the row-wise log-softmax (backend/batch_invariant.py)."""
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits [num_seqs, vocab] float32, one row per sequence."""
        token_list = self.sample(logits, seqs).tolist()
        return SamplerOutput(token_ids=token_list, logprobs=self.logprobs(logits, seqs, token_list))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], grammar_masks: torch.Tensor | None = None) -> torch.Tensor:
        """The next token of each row, left on the logits' device: nothing here waits for
        the device, so the engine can schedule the next step while this one runs (a
        structured output's row waits: its grammar checks the token on the host).
        grammar_masks: the constrained rows' token bitmasks, row for row (a verify's rows of one
        request each need the grammar's state after their own drafts); None: from the matchers."""
        logits = self.apply_processors(logits, seqs, grammar_masks)
        if all(seq.params.greedy for seq in seqs):
            tokens, race = first_max_index(logits), None
        else:
            tokens, race = self._sample(logits, seqs)
        late = [i for i, seq in enumerate(seqs) if seq.grammar is not None and masks_late(seq.params)]
        if late:
            self._follow_grammars(logits, race, tokens, seqs, late, grammar_masks)
        return tokens

    # -- logit processors ------------------------------------------------------
    def apply_processors(self, logits: torch.Tensor, seqs: list[Sequence],
                         grammar_masks: torch.Tensor | None = None) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if _has_processors(s)]
        if not rows:
            return logits
        logits = logits.clone()
        constrained = [i for i in rows if _masks_before_draw(seqs[i].params)]
        for i in rows:
            seq, row = seqs[i], logits[i]
            p = seq.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
                scores = row[seen]
                row[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                counts = torch.bincount(
                    torch.tensor(seq.output_token_ids, device=row.device), minlength=row.shape[0]
                ).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            banned = self._banned_tokens(seq)
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
        if constrained:  # last: what the grammar allows, of what the other processors left
            _mask(logits, constrained, seqs, grammar_masks)
        return logits

    def _banned_tokens(self, seq: Sequence) -> list[int]:
        p = seq.params
        banned: list[int] = []
        if seq.num_output_tokens < p.min_tokens:
            banned += sorted(p.ending_token_ids(self.eos_token_ids))
        output = seq.output_token_ids
        for word in p.bad_words_ids:
            prefix = word[:-1]
            if not prefix or output[len(output) - len(prefix) :] == prefix:
                banned.append(word[-1])
        return banned

    def _follow_grammars(self, logits: torch.Tensor, race: Race | None, tokens: torch.Tensor,
                         seqs: list[Sequence], rows: list[int], grammar_masks: torch.Tensor | None) -> None:
        """Replace, in `tokens`, each of `rows`' token that its grammar does not allow by the
        winner among the allowed ones: the greedy row's largest logit, the sampled row's race
        run again in log space (log p - log E orders as p / E, and no allowed token's
        probability underflows to zero beside a disallowed favourite)."""
        chosen = tokens[_to(rows, tokens.device, torch.int64)].tolist()
        broken = [i for i, token in zip(rows, chosen)
                  if not (allows(seqs[i].grammar, token) if grammar_masks is None else bitmask_allows(grammar_masks, i, token))]
        if not broken:
            return
        noise = {} if race is None else {i: race.noise[j] for j, i in enumerate(race.rows)}
        scores = torch.stack([logits[i] / seqs[i].params.temperature - noise[i].log() if i in noise else logits[i]
                              for i in broken])
        _mask(scores, list(range(len(broken))), [seqs[i] for i in broken],
              None if grammar_masks is None else grammar_masks[broken])
        tokens[_to(broken, tokens.device, torch.int64)] = first_max_index(scores)

    # -- sampling --------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, Race]:
        """Each row's token (greedy rows' argmax) and the draw's noise."""
        params = [s.params for s in seqs]
        greedy = first_max_index(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        index = _to(rows, logits.device, torch.int64)
        temps = _to([params[i].temperature for i in rows], logits.device, logits.dtype)
        scaled = logits[index] / temps[:, None]
        scaled = _top_k_top_p_min_p(scaled, [params[i] for i in rows])
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            self._draw(noise[j], seqs[i])
        greedy[index] = first_max_index(probs / noise)
        return greedy, Race(rows, noise)

    def _draw(self, noise: torch.Tensor, seq: Sequence) -> None:
        """One row's race noise, from the request's own generator where it has a seed."""
        noise.exponential_(generator=seq.generator or self.generator)

    def redraw(self, seq: Sequence, state: torch.Tensor, draws: int, vocab: int) -> None:
        """Rewind a seeded request's generator to `state` and draw its first `draws` rows
        again: a verify drew a row for every draft, and the draws of rejected rows belong to the
        tokens that follow, as they would without speculation."""
        assert seq.generator is not None
        seq.generator.set_state(state)
        row = torch.empty(vocab, dtype=torch.float32, device=self.device)
        for _ in range(draws):
            self._draw(row, seq)

    def logprobs(self, raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
        """Logprobs of the sampled tokens (and the top alternatives) for the rows that ask,
        from the model's raw distribution."""
        params = [seq.params for seq in seqs]
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(params)
        if not rows:
            return result
        raw_rows = raw[torch.tensor(rows, device=raw.device)]
        logprobs = dispatch.invariant_log_softmax(raw_rows) if self.batch_invariant else raw_rows.log_softmax(dim=-1)
        top_n = max(params[i].logprobs or 0 for i in rows)  # set in every row of `rows`
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        chosen = logprobs[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])]
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        for j, i in enumerate(rows):
            n = params[i].logprobs
            top = (list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist()))
                   if n and top_ids is not None and top_values is not None else [])
            result[i] = TokenLogprob(tokens[i], chosen[j].item(), int(ranks[j]), top)
        return result


@dataclass
class Race:
    """A step's exponential race: the sampled rows (indexes into the batch) and their noise."""

    rows: list[int]
    noise: torch.Tensor


def _mask(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], grammar_masks: torch.Tensor | None) -> None:
    """Mask logits' rows by their grammars: the given bitmask's same rows, else each row's matcher
    (`seqs` row for row with logits)."""
    if grammar_masks is not None:
        apply_bitmask(logits, grammar_masks, rows)
    else:
        mask_logits(logits, rows, [seqs[i].grammar for i in rows])


def masks_late(params: SamplingParams) -> bool:
    """Whether a constrained row's mask can wait for its draw (see the module's docstring):
    greedy, or sampled with no top-k, top-p or min-p, which would choose among the allowed
    tokens rather than among all."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)


def _masks_before_draw(params: SamplingParams) -> bool:
    """Whether a row's grammar masks its logits among the processors (not `masks_late`)."""
    return params.structured_outputs is not None and not masks_late(params)


def _has_processors(seq: Sequence) -> bool:
    p = seq.params
    return (p.needs_penalties or bool(p.bad_words_ids) or (p.min_tokens > 0 and seq.num_output_tokens < p.min_tokens)
            or (p.structured_outputs is not None and _masks_before_draw(p)))


def _top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top-k, nucleus (top-p) and min-p sets."""
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]  # a top_k past the vocabulary keeps it all
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < logits.shape[-1] for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        k = _to(top_k, logits.device, torch.int64)
        drop = ranks[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        p = _to(top_p, logits.device, probs.dtype)
        drop |= before > p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        m = _to(min_p, logits.device, probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * m[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _to(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small host list on the device without waiting for the device (torch.tensor(...,
    device=cuda) copies synchronously: it would wait for the step in flight)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def first_max_index(rows: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximum, NaN counting as largest, as argmax).
    On CPU one C pass a row (kernels/cpu/first_max.py: several times faster than torch's
    max(dim) on a step's logits; benchmarks/RESULTS.md, "Zen 4: CPU kernels"); elsewhere
    `max(dim).indices`, because torch's CPU argmax is slower still. The tests pin equality
    with argmax, ties included."""
    fast = dispatch.first_max_index(rows)
    return fast if fast is not None else rows.max(dim=-1).indices
