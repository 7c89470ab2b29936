"""Scheduler: picks each step's work under one token budget.

No prefill and decode phases: running requests come first (a decode costs one
token, an unfinished prompt its next chunk), then waiting requests are admitted
with their cached prefix, their prompt chunked to fit what is left of the
budget. When KV blocks run out, the newest running request is preempted and
recomputed later. The `static` policy (a fixed batch runs until its longest
member ends) exists only so benchmarks can show what in-flight batching buys.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .errors import QueueFullError
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of tokens it computes now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

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
    ):
        self.kv = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue_size = max_queue_size
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.peak_num_running = 0
        self._static_batch_open = True

    # -- requests --------------------------------------------------------------
    def is_full(self, arriving: int = 0) -> bool:
        """True when `arriving` more requests would overflow the waiting queue
        (max_queue_size beyond the free running slots)."""
        free_slots = max(0, self.max_num_seqs - len(self.running))
        return len(self.waiting) + arriving >= self.max_queue_size + free_slots

    def add(self, seq: Sequence) -> None:
        if self.is_full():
            raise QueueFullError(
                f"server busy: {len(self.waiting)} requests are waiting "
                f"(max_queue_size={self.max_queue_size}); retry later"
            )
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
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- scheduling ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if batch.num_preempted == 0 and self._may_admit():
            self._schedule_waiting(batch, budget)
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    return budget
            batch.add(seq, num_new)
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        if self.policy == "static" and (len(self.running) >= self.max_num_seqs or not self.waiting):
            self._static_batch_open = False

    def _may_admit(self) -> bool:
        if self.policy != "static":
            return True
        if not self.running:
            self._static_batch_open = True
        return self._static_batch_open

    def _preempt(self, seq: Sequence) -> None:
        """Free all of seq's blocks and queue it first in line to be recomputed."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
