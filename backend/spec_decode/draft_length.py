"""How many drafts each request verifies this step: the number that gives the most tokens a second.

A step of n decoding requests gives n tokens in cost(n) seconds. Verifying D draft rows more
costs cost(n + D) and gives, on average, the sum of the rows' chances to be kept: a request's
j-th draft is kept when it and every draft before it are accepted, alpha**j for a request whose
per-token acceptance is alpha. The step takes the D most likely rows (across requests) for the D
that maximizes (n + their sum) / cost(n + D), and D = 0 when no D beats the plain step. So
drafting backs off per request (alpha low: its rows are the least likely) and engine-wide (where
rows are dear at this batch size), from measurements of this engine alone:

- cost is the measured seconds of decode-only steps (decodes and verifies, no prompt chunk) by
  their query tokens, each size's recent mean, read between measured sizes along straight lines.
  Measured, not modelled: a CPU's step jumps where the row count leaves a kernel's few-row path,
  a GPU's hardly moves until the tensor cores fill. A plain step at a size outside the measured
  ones is measured first, and while it is the only size measured every request drafts all it may,
  which measures a larger one; a plain size is measured again every REMEASURE drafting steps;
- a draft model's forwards are timed apart from the target's step, by their tokens, and a
  choice's seconds add one forward per draft position over the requests drafting that far;
- alpha is a request's accepted drafts over the drafts it reached (a verify stops at its first
  rejection), from a prior of one in two, weighted to its recent verifies;
- a request held back still proposes (a shadow draft, never verified: the proposer's lookup is
  all it costs) whenever it has none outstanding, and once its next tokens are known they say
  how much of the shadow would have been accepted; so a request that starts repeating its prompt
  drafts again without paying a verify to find out. (Probing with real verifies would cost a
  CPU at 8 streams about a tenth of its rate: a lone extra row there costs a quarter of a step.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sequence import Sequence

def num_kept(drafts: list[int], tokens: list[int]) -> int:
    """How many leading drafts equal the tokens that came (a verify keeps those and stops)."""
    kept = 0
    while kept < min(len(drafts), len(tokens)) and tokens[kept] == drafts[kept]:
        kept += 1
    return kept


@dataclass
class StepCost:
    """Seconds of a decode-only step by its query tokens."""

    RECENT = 0.7
    """An observation's weight against the size's earlier mean."""
    OUTLIER = 0.1
    """The weight of one over twice the mean: a collection pause or another process's burst moves
    it a little, where at RECENT a single stall could make drafting look free until measured again."""
    seconds: dict[int, float] = field(default_factory=dict)
    _sizes: list[int] = field(default_factory=list)

    def observe(self, tokens: int, seconds: float) -> None:
        known = self.seconds.get(tokens)
        if known is None:
            bisect.insort(self._sizes, tokens)
            self.seconds[tokens] = seconds
        else:
            weight = self.OUTLIER if seconds > 2 * known else self.RECENT
            self.seconds[tokens] = (1 - weight) * known + weight * seconds

    def covers(self, tokens: int) -> bool:
        """Whether this size is measured or lies between measured ones."""
        return bool(self._sizes) and self._sizes[0] <= tokens <= self._sizes[-1]

    def at(self, tokens: int) -> float | None:
        """The step's seconds at this size, measured or read along the line through the nearest
        measured sizes (None before two sizes are measured)."""
        exact = self.seconds.get(tokens)
        if exact is not None:
            return exact
        sizes = self._sizes
        if len(sizes) < 2:
            return None
        i = min(max(bisect.bisect_left(sizes, tokens), 1), len(sizes) - 1)
        low, high = sizes[i - 1], sizes[i]
        slope = max((self.seconds[high] - self.seconds[low]) / (high - low), 0.0)
        return max(self.seconds[low] + slope * (tokens - low), 0.0)


@dataclass
class Acceptance:
    """A request's per-token acceptance: accepted drafts over drafts reached, recent ones weighted."""

    accepted: float = 1.0
    reached: float = 2.0

    RECENT = 0.8

    def update(self, drafted: int, accepted: int) -> None:
        self.accepted = self.RECENT * self.accepted + accepted
        self.reached = self.RECENT * self.reached + accepted + (accepted < drafted)

    @property
    def rate(self) -> float:
        return self.accepted / self.reached


class DraftLengths:
    """Per step: each request's draft length; learns from step times and verifies."""

    def __init__(self, num_speculative_tokens: int, adaptive: bool = True, draft_model: bool = False):
        self.k = num_speculative_tokens
        self.adaptive = adaptive
        self.cost = StepCost()
        """The target's step (the draft model's time taken out)."""
        self.draft_cost = StepCost() if draft_model else None
        """A draft model's forward by its tokens: drafting D rows costs a forward per draft position,
        each over the requests drafting that far."""
        self.num_backed_off = 0
        """Request-steps where a decoding request that could draft was given no drafts."""
        self.row_cost = 0.0
        """What one more row adds to a plain step's time at the last step's batch size, relative to it."""
        self._could_pay: bool | None = None
        self._step = (0, 0.0, 0)
        """This step's running requests, plain seconds, decoding requests."""
        self._acceptance: dict[Sequence, Acceptance] = {}
        self._shadows: dict[Sequence, tuple[int, list[int]]] = {}
        """Per held-back request: where its shadow draft starts in its tokens, and the draft."""
        self._lengths: dict[Sequence, int] = {}
        self._drafting_steps: dict[int, int] = {}
        """Steps that drafted, by the number of running requests."""

    REMEASURE = 32
    """Every this many drafting steps at a batch size, a plain step measures it again."""

    def begin_step(self, running: list[Sequence], decoding: list[Sequence]) -> None:
        """Choose this step's lengths for the running requests that may draft (`decoding`), and
        forget requests no longer running."""
        if len(self._acceptance) > len(running) or len(self._shadows) > len(running):
            alive = set(running)
            self._acceptance = {seq: value for seq, value in self._acceptance.items() if seq in alive}
            self._shadows = {seq: value for seq, value in self._shadows.items() if seq in alive}
        if not self.adaptive:
            return
        if self._shadows:
            self._check_shadows(decoding)
        n = len(running)
        plain, more = self.cost.at(n), self.cost.at(n + 1)
        self.row_cost = (more - plain) / plain if plain and more is not None else 0.0
        self._could_pay, self._step = None, (n, plain or 0.0, len(decoding))
        if not self.cost.covers(n):
            # the plain step at this size is measured first (read off a line through other sizes it
            # can be far off, and a drafting step never measures it)
            lengths = dict.fromkeys(decoding, 0)
        elif plain and more is not None:
            lengths = self._best(decoding, n, plain)
            if any(lengths.values()):  # and measured again now and then while drafting: one slow step stays otherwise
                drafting = self._drafting_steps[n] = self._drafting_steps.get(n, 0) + 1
                if drafting % self.REMEASURE == 0:
                    lengths = dict.fromkeys(decoding, 0)
        else:  # the plain step is the one size measured: every request drafts all it may, measuring a larger one
            lengths = dict.fromkeys(decoding, self.k)
        self.num_backed_off += sum(1 for length in lengths.values() if length == 0)
        self._lengths = lengths

    def _best(self, decoding: list[Sequence], n: int, plain: float) -> dict[Sequence, int]:
        """The lengths of the D most likely rows, for the D with the most tokens a second."""
        rows = sorted(((self._rate(seq) ** j, index) for index, seq in enumerate(decoding) for j in range(1, self.k + 1)),
                      reverse=True)
        best_d = self._scan(rows, len(decoding), n, plain)[0]
        lengths = dict.fromkeys(decoding, 0)
        for _, index in rows[:best_d]:
            lengths[decoding[index]] += 1
        return lengths

    MARGIN = 0.02
    """Drafts must beat the plain step's tokens a second by this much: where rows cost nothing
    measurable and drafts are never kept, the step times' noise would decide otherwise."""

    def _scan(self, rows: list[tuple[float, int]], num_decoding: int, n: int, plain: float) -> tuple[int, float]:
        """(D, tokens a second) of the best first D of `rows` ((chance kept, request), in the
        order taken), D = 0 for the plain step."""
        best_d, best_rate, expected = 0, (1 + self.MARGIN) * n / plain, float(n)
        counts, rounds, drafting = [0] * num_decoding, [0] * self.k, 0.0
        for d, (value, index) in enumerate(rows, start=1):
            expected += value
            if self.draft_cost is not None:  # the request's next position: one more in that position's forward
                position = counts[index]
                drafting += self._draft_at(rounds[position] + 1) - self._draft_at(rounds[position])
                rounds[position] += 1
            counts[index] += 1
            seconds = self.cost.at(n + d)
            if seconds and expected / (seconds + drafting) > best_rate:
                best_d, best_rate = d, expected / (seconds + drafting)
        return best_d, best_rate

    def _draft_at(self, tokens: int) -> float:
        assert self.draft_cost is not None
        return (self.draft_cost.at(tokens) or 0.0) if tokens else 0.0

    def drafts_could_pay(self) -> bool:
        """Whether, at this step's batch size, drafts that are always accepted would beat the plain
        step (when not, no acceptance makes them pay, and a costly shadow draft tells nothing)."""
        if self._could_pay is None:
            n, plain, decoding = self._step
            always = [(1.0, index) for _ in range(self.k) for index in range(decoding)]
            self._could_pay = not plain or self._scan(always, decoding, n, plain)[0] > 0
        return self._could_pay

    def length(self, seq: Sequence) -> int:
        """How many drafts `seq` should verify this step (before the budget's and limits' caps)."""
        return self._lengths.get(seq, self.k) if self.adaptive else self.k

    def wants_shadow(self, seq: Sequence) -> bool:
        """Whether a held-back request should propose a shadow draft now (it has none outstanding)."""
        return seq not in self._shadows

    def shadow(self, seq: Sequence, drafts: list[int]) -> None:
        """A held-back request's proposal for the tokens after its current ones, kept unverified."""
        if drafts:
            self._shadows[seq] = (seq.num_tokens, drafts)

    def _check_shadows(self, decoding: list[Sequence]) -> None:
        """Score each shadow draft whose outcome is known: every drafted position's token is in, or
        one of them differs (a verify would have stopped there)."""
        for seq in decoding:
            entry = self._shadows.get(seq)
            if entry is None:
                continue
            start, drafts = entry
            known = seq.token_ids[start : start + len(drafts)]
            kept = num_kept(drafts, known)
            if kept < len(known) or len(known) == len(drafts):
                self._entry(seq).update(len(drafts), kept)
                del self._shadows[seq]

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self._entry(seq).update(drafted, accepted)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step's query tokens and its seconds (launch to tokens on the host, a draft
        model's time taken out)."""
        self.cost.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """A draft model's forward over this many tokens and its seconds."""
        assert self.draft_cost is not None
        self.draft_cost.observe(tokens, seconds)

    def _rate(self, seq: Sequence) -> float:
        return (self._acceptance.get(seq) or Acceptance()).rate

    def _entry(self, seq: Sequence) -> Acceptance:
        return self._acceptance.setdefault(seq, Acceptance())
