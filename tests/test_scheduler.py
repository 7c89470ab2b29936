"""Scheduler: one token budget, chunked prefill, preemption, queue bound, abort, static policy."""

import pytest

from pagedserve.backend.block_manager import BlockManager
from pagedserve.backend.errors import QueueFullError
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.scheduler import Scheduler
from pagedserve.backend.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=32, block_size=4, budget=64, max_seqs=8, queue=16, policy="inflight"):
    kv = BlockManager(num_blocks, block_size)
    return kv, Scheduler(kv, max_seqs, budget, queue, policy)


def seq(name, n, start=0, max_tokens=16):
    return Sequence(name, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run(sched, batch, token=7):
    """A forward that samples `token` for every sequence whose prompt is done."""
    return sched.update_from_output(batch, [token] * len(batch.sampling_seqs))


def plan(batch):
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_prefill_is_chunked_to_the_token_budget_and_decodes_go_first():
    kv, sched = make(budget=10)
    a, b = seq("a", 6), seq("b", 8, start=50)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert plan(first) == [("a", 6), ("b", 4)]
    run(sched, first)
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0  # b's prompt is unfinished
    second = sched.schedule()
    assert plan(second) == [("a", 1), ("b", 4)]
    run(sched, second)
    third = sched.schedule()
    assert plan(third) == [("a", 1), ("b", 1)]


def test_waiting_request_reuses_cached_prefix():
    kv, sched = make(block_size=4)
    a = seq("a", 12)
    sched.add(a)
    run(sched, sched.schedule())
    b = Sequence("b", list(range(8)) + [99, 98], SamplingParams())
    sched.add(b)
    batch = sched.schedule()
    assert plan(batch) == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert kv.prefix_hit_rate == pytest.approx(8 / 22)


def test_newest_running_request_is_preempted_when_blocks_run_out():
    kv, sched = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7), seq("b", 7, start=100)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # a: 2 blocks, b: 2 blocks; each now 8 tokens
    assert kv.num_free_blocks == 0
    run(sched, sched.schedule())  # both decode into the last slot of their second block
    batch = sched.schedule()  # a needs a third block: b (newest) is preempted
    assert plan(batch) == [("a", 1)]
    assert batch.num_preempted == 1 and sched.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b]
    run(sched, batch)
    sched.finish(a, FinishReason.STOP)
    batch = sched.schedule()  # b is recomputed: 9 tokens, its first block still cached
    assert plan(batch) == [("b", 5)] and b.num_cached_tokens == 4


def test_a_request_that_cannot_grow_preempts_itself_last():
    kv, sched = make(num_blocks=2, block_size=4)
    a = seq("a", 8)
    sched.add(a)
    run(sched, sched.schedule())
    batch = sched.schedule()
    assert plan(batch) == [] and a.status is SequenceStatus.WAITING


def test_queue_bound_refuses_with_a_busy_error_beyond_free_running_slots():
    kv, sched = make(queue=2, max_seqs=1)
    for name in "abc":  # one will run at once, two may wait
        sched.add(seq(name, 4, start=ord(name)))
    with pytest.raises(QueueFullError, match="retry later"):
        sched.add(seq("d", 4))
    sched.schedule()
    assert sched.num_running == 1 and sched.num_waiting == 2
    with pytest.raises(QueueFullError):
        sched.add(seq("d", 4))


def test_abort_frees_blocks_at_once_from_running_and_waiting():
    kv, sched = make(max_seqs=1)
    a, b = seq("a", 9), seq("b", 9, start=20)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    assert kv.num_used_blocks == 3
    assert sched.abort("a") is a
    assert kv.num_used_blocks == 0 and a.finish_reason is FinishReason.ABORT
    assert sched.abort("b") is b
    assert not sched.has_unfinished() and not sched.waiting and not sched.running
    assert sched.abort("missing") is None


def test_max_num_seqs_caps_running_requests():
    kv, sched = make(max_seqs=2)
    for i in range(3):
        sched.add(seq(f"r{i}", 4, start=10 * i))
    assert [s.request_id for s in sched.schedule().seqs] == ["r0", "r1"]
    assert sched.num_waiting == 1


def test_static_policy_admits_only_when_the_batch_is_done():
    kv, sched = make(max_seqs=2, policy="static")
    a, b, c = seq("a", 4), seq("b", 4, start=10), seq("c", 4, start=20)
    for s in (a, b, c):
        sched.add(s)
    run(sched, sched.schedule())
    sched.finish(a, FinishReason.STOP)
    assert plan(sched.schedule()) == [("b", 1)]  # c waits although a slot is free
    sched.finish(b, FinishReason.LENGTH)
    assert plan(sched.schedule()) == [("c", 4)]


def test_update_finishes_on_eos_or_stop_id_only_after_min_tokens():
    kv = BlockManager(32, 4)
    sched = Scheduler(kv, 8, 64, 16, eos_token_ids=[0])
    a = Sequence("a", [5, 6], SamplingParams(max_tokens=16, min_tokens=2, stop_token_ids=[3]))
    b = Sequence("b", [5, 6], SamplingParams(max_tokens=16, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule(), token=0)  # a's first token: below min_tokens; b ignores EOS
    assert not a.is_finished and not b.is_finished
    run(sched, sched.schedule(), token=3)  # a's second token is a stop id: done
    assert a.finish_reason is FinishReason.STOP and a.block_table == []
    assert not b.is_finished and sched.generation_tokens_total == 4


def test_update_finishes_at_max_tokens_and_max_model_len_and_counts_tokens():
    kv = BlockManager(32, 4)
    sched = Scheduler(kv, 8, 64, 16, max_model_len=7)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=2))
    b = Sequence("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=16))
    sched.add(a)
    sched.add(b)
    assert run(sched, sched.schedule()) == [a, b]
    run(sched, sched.schedule())
    assert a.finish_reason is FinishReason.LENGTH and a.num_output_tokens == 2
    assert b.finish_reason is FinishReason.LENGTH and b.num_tokens == 7
    assert sched.prompt_tokens_total == 8 and not sched.has_unfinished()
    assert kv.num_used_blocks == 0


def test_a_later_stop_reason_replaces_length_without_freeing_twice():
    kv, sched = make()
    a = seq("a", 3, max_tokens=1)
    sched.add(a)
    run(sched, sched.schedule())
    assert a.finish_reason is FinishReason.LENGTH
    sched.finish(a, FinishReason.STOP)  # the same token also completed a stop string
    assert a.finish_reason is FinishReason.STOP and kv.num_free_blocks == kv.num_blocks


def test_borrowed_blocks_return_at_exit_and_need_an_idle_scheduler():
    kv, sched = make(num_blocks=8, block_size=4)
    with sched.borrowed_blocks(10) as table:
        assert len(table) == 3 and kv.num_used_blocks == 3
    assert kv.num_used_blocks == 0
    sched.add(seq("a", 4))
    with pytest.raises(RuntimeError, match="idle"):
        with sched.borrowed_blocks(4):
            pass
