"""Scheduler: picks each step's work under one token budget.

No prefill and decode phases: running requests come first (a decode costs one
token, an unfinished prompt its next chunk), then waiting requests are admitted
with their cached prefix, their prompt chunked to fit what is left of the
budget. When KV blocks run out, the newest running request is preempted and
recomputed later. The `static` policy (a fixed batch runs until its longest
member ends) exists only so benchmarks can show what in-flight batching buys.

The scheduler owns the per-step state machine, as vLLM v1's does: `schedule()`
decides the step's work, `update_from_output()` applies what the model computed
(computed tokens, full blocks named for prefix reuse, the sampled token) and
finishes requests that hit a stop token id, max_tokens or max_model_len. Only
the scheduler touches the BlockManager; the engine asks it.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence as Seq, cast

from .block_manager import BlockManager
from .errors import InvalidRequestError, QueueFullError
from .outputs import StepCounts
from .sampling_params import SamplingParams
from .sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from .multimodal.encoder_budget import EncoderBudget
    from .spec_decode import Speculator


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of tokens it computes now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    starts: list[int] = field(default_factory=list)
    """Each sequence's computed tokens before this step (set when the step is committed)."""
    sampling_seqs: list[Sequence] = field(default_factory=list)
    """The sequences that sample a token this step (their last scheduled token is their last)."""
    samples: list[bool] = field(default_factory=list)
    """Per sequence: whether it samples this step (set when the step is committed)."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per sequence: the draft tokens it verifies this step (speculative decoding), computed
    after its last token and counted in num_new_tokens; empty for most."""

    def add(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.drafts.append(drafts or [])

    def drafts_of(self, seq_index: int) -> list[int]:
        return self.drafts[seq_index] if self.drafts else []

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    def commit(self) -> None:
        """Count the step's tokens as computed now, and its samples as pending, so the next
        step can be scheduled before this one's results are back (async scheduling)."""
        self.starts = [seq.num_computed_tokens for seq in self.seqs]
        for index, (seq, num_new) in enumerate(zip(self.seqs, self.num_new_tokens)):
            seq.num_computed_tokens += num_new
            samples = seq.num_computed_tokens - len(self.drafts_of(index)) == seq.num_tokens
            self.samples.append(samples)
            if samples:
                seq.num_pending_tokens += 1
                self.sampling_seqs.append(seq)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def decode_only(self) -> bool:
        """Every sequence decodes or verifies (no prompt chunk, not even a one-token rest of a
        prompt the prefix cache held: a request's first step costs more): the steps a speculator times."""
        return (all(self.samples) and all(n == 1 + len(d) for n, d in zip(self.num_new_tokens, self.drafts))
                and all(start >= seq.num_prompt_tokens for seq, start in zip(self.seqs, self.starts)))

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_queue_size: int,
        policy: str = "inflight",
        max_model_len: int | None = None,
        eos_token_ids: Seq[int] = (),
        max_loras: int = 0,
        speculator: Speculator | None = None,
        encoder_budget: EncoderBudget | None = None,
    ):
        """max_loras > 0: requests of at most that many LoRA adapters run at once (the device's
        slots); the first waiting request of another adapter waits, and those behind it, until a
        running adapter's last request finishes (first come, first served). encoder_budget: how
        much vision encoding a step may take (multimodal/encoder_budget.py)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue_size = max_queue_size
        self.policy = policy
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.max_loras = max_loras
        self.speculator = speculator
        """Speculative decoding's proposer and verifier (None: off)."""
        self.encoder_budget = encoder_budget
        """A vision-language model's vision encoding per step (None: a text model)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.peak_num_running = 0
        self.prompt_tokens_total = 0
        """Prompt tokens of every request that started (a recomputed one counts once)."""
        self.generation_tokens_total = 0
        self.last_step = StepCounts()
        """What the latest non-empty step runs (TensorRT-LLM's in-flight batcher metrics read it)."""
        self._static_batch_open = True

    # -- requests --------------------------------------------------------------
    def check_room(self, arriving: int = 0) -> None:
        """Raise QueueFullError when one more request (after `arriving` already accepted
        elsewhere) would overflow the waiting queue: max_queue_size beyond the free
        running slots."""
        free_slots = max(0, self.max_num_seqs - len(self.running))
        waiting = len(self.waiting) + arriving
        if waiting >= self.max_queue_size + free_slots:
            raise QueueFullError(
                f"server busy: {waiting} requests are waiting (max_queue_size={self.max_queue_size}); retry later"
            )

    def add(self, seq: Sequence, check_room: bool = True) -> None:
        """Queue a sequence; the forks of an admitted request (n > 1) skip the room check."""
        if check_room:
            self.check_room()
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks at once."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request and free its blocks; on an already finished one, only the
        reason changes (a stop string found in the step that reached max_tokens)."""
        if seq.status is SequenceStatus.FINISHED:
            seq.finish_reason = reason
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)  # preempted while its last step ran, then ended by that step's token
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def lora_adapters(self, queue: Iterable[Sequence]) -> tuple[str, ...]:
        """The LoRA adapters `queue`'s requests name, sorted (vLLM's lora_requests_info labels)."""
        return tuple(sorted({s.params.lora_name for s in queue if s.params.lora_name is not None}))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @contextmanager
    def borrowed_blocks(self, num_tokens: int) -> Iterator[list[int]]:
        """A block table for num_tokens outside any request, for a one-off prefill
        (prompt scoring); needs an idle scheduler, and the blocks return at exit."""
        if self.requests:
            raise RuntimeError("borrowing KV blocks needs an idle engine")
        borrower = Sequence("borrowed", [], SamplingParams())
        if not self.block_manager.allocate(borrower, num_tokens):
            raise InvalidRequestError("prompt", "does not fit the KV cache")
        try:
            yield borrower.block_table
        finally:
            self.block_manager.free(borrower)

    # -- scheduling ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.encoder_budget is not None:
            self.encoder_budget.begin_step()
        budget = self._schedule_running(batch, budget)
        if batch.num_preempted == 0 and self._may_admit():
            self._schedule_waiting(batch, budget)
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                self.prompt_tokens_total += seq.num_prompt_tokens
        if batch.seqs:
            self.last_step = StepCounts.of(batch, self.last_step.iteration + 1)
        batch.commit()
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        drafting = self.speculator is not None and self.speculator.drafts_allowed(len(self.running))
        if drafting and self.speculator is not None:
            self.speculator.begin_step(self.running)
        later_needs = self._later_block_needs() if drafting else []
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_pending_tokens and seq.reaches_limit(self.max_model_len):
                index += 1  # its token in flight ends it: it finishes when that token arrives
                continue
            wanted = min(seq.num_uncomputed_tokens, budget)
            num_new = self._encodable(seq, seq.num_computed_tokens, wanted)
            if num_new == 0 < wanted:  # its next image waits for a step with encoder budget left
                index += 1
                continue
            drafts = self._drafts(seq, budget) if drafting else []
            if drafts:
                spare = self.block_manager.num_free_blocks - self.block_manager.blocks_needed(seq, 1 + len(drafts))
                if spare >= later_needs[index + 1] and self.block_manager.allocate(seq, 1 + len(drafts)):
                    num_new = 1 + len(drafts)
                else:
                    drafts = []  # never preempt a request to make room for drafts
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    return budget
            batch.add(seq, num_new, drafts)
            budget -= num_new
            index += 1
        return budget

    def _later_block_needs(self) -> list[int]:
        """Per running index: the blocks the requests from there on need for their own tokens
        (drafts may take only what is left beyond them, so they never cause a preemption)."""
        needs = [0] * (len(self.running) + 1)
        for i in range(len(self.running) - 1, -1, -1):
            seq = self.running[i]
            needs[i] = needs[i + 1] + self.block_manager.blocks_needed(seq, seq.num_uncomputed_tokens)
        return needs

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """A decoding request's draft tokens: at most what the budget leaves beside its own token,
        and few enough that all accepted plus the model's own token stay within max_tokens and
        max_model_len."""
        speculator = self.speculator
        if speculator is None or not speculator.may_draft(seq):
            return []
        cap = min(budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            cap = min(cap, self.max_model_len - seq.num_tokens - 1)
        return speculator.propose(seq, cap) if cap > 0 else []

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while its last step ran: back once that step's token is in
            if not self._adapter_fits(seq):
                break
            cached = self._shared_prompt_blocks(seq) or self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = self._encodable(seq, num_cached, min(seq.num_tokens - num_cached, budget))
            if num_new == 0 or not self.block_manager.allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            self.block_manager.record_prefix_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        if self.policy == "static" and (len(self.running) >= self.max_num_seqs or not self.waiting):
            self._static_batch_open = False

    def _encodable(self, seq: Sequence, start: int, num_new: int) -> int:
        """Of seq's chunk, what the step's encoder budget lets it take (all of it for text)."""
        return num_new if self.encoder_budget is None else self.encoder_budget.cut(seq, start, num_new)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether seq's LoRA adapter runs already or a slot is left for it."""
        name = seq.params.lora_name
        if name is None or not self.max_loras:
            return True
        running = {s.params.lora_name for s in self.running} - {None}
        return name in running or len(running) < self.max_loras

    def _shared_prompt_blocks(self, seq: Sequence) -> list:
        """A fork's share of its first sample's full prompt blocks (never the block of
        the last prompt token: its logits are needed), while that sample holds them."""
        first = seq.fork_of
        if first is None or first.is_finished or first.num_computed_tokens < first.num_prompt_tokens:
            return []
        num_full = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        return [self.block_manager.blocks[i] for i in first.block_table[:num_full]]

    def _may_admit(self) -> bool:
        if self.policy != "static":
            return True
        if not self.running:
            self._static_batch_open = True
        return self._static_batch_open

    def _preempt(self, seq: Sequence) -> None:
        """Free all of seq's blocks and queue it first in line to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the forward -----------------------------------------------------
    def update_from_output(
        self,
        batch: ScheduledBatch,
        token_ids: Seq[int] | Seq[Seq[int]],
        logprobs: list | None = None,
        on_token: Callable[[Sequence], bool] | None = None,
    ) -> list[Sequence]:
        """Apply one step's results: name newly full blocks, append each sampled token and
        finish requests it ends. A sequence that ended while the step ran (a stop found in
        the step before, with async scheduling) drops its token. Returns the sequences
        that got a token.

        With speculative decoding a sequence's entry is a list: its accepted drafts and the
        model's own token. Its computed tokens are first rolled back to the accepted ones (and
        whole blocks past them returned), so no block holding a rejected draft's K/V is ever
        named; then its tokens are applied one at a time, each checked as a plain step's
        (stop token, length, then `on_token`: the engine's stop-string check), and the first
        that ends it drops the rest. logprobs follows token_ids' shape."""
        for seq, samples in zip(batch.seqs, batch.samples or [False] * len(batch.seqs)):
            if not samples and not seq.is_finished:  # a sampling one is named after its token, below
                self.block_manager.cache_full_blocks(seq)
        drafts = {id(seq): d for seq, d in zip(batch.seqs, batch.drafts) if d} if batch.drafts else {}
        now = time.monotonic()
        advanced = []
        for index, (seq, entry) in enumerate(zip(batch.sampling_seqs, token_ids)):
            if seq.is_finished:
                continue
            tokens: list[int] = [entry] if isinstance(entry, int) else list(cast(Seq[int], entry))
            entry_logprobs = logprobs[index] if logprobs is not None else None
            if entry_logprobs is None or isinstance(entry, int):
                entry_logprobs = [entry_logprobs] * len(tokens)
            draft = drafts.get(id(seq))
            if draft is not None:
                self._roll_back(seq, len(draft) - (len(tokens) - 1))
            seq.num_pending_tokens -= 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            advanced.append(seq)
            for token, token_logprob in zip(tokens, entry_logprobs):
                seq.append_token(token)
                if token_logprob is not None:
                    seq.logprobs.append(token_logprob)
                self.generation_tokens_total += 1
                self.block_manager.cache_full_blocks(seq)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                if on_token is not None and on_token(seq):
                    self.finish(seq, FinishReason.STOP)
                if seq.is_finished:
                    break
        return advanced

    def _roll_back(self, seq: Sequence, num_rejected: int) -> None:
        """Forget the K/V of seq's rejected drafts: computed tokens back to the accepted ones,
        whole blocks past them freed."""
        if num_rejected <= 0:
            return
        seq.num_computed_tokens -= num_rejected
        self.block_manager.trim(seq, seq.num_computed_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        outputs = seq.num_output_tokens
        if outputs >= params.min_tokens and token in params.ending_token_ids(self.eos_token_ids):
            return FinishReason.STOP
        if outputs >= params.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None
