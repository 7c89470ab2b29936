"""BlockManager: exact block ids, reference counts, prefix reuse and eviction order."""

import pytest

from pagedserve.backend.block_manager import BlockManager, FreeBlockQueue, KVBlock
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.sequence import Sequence


def seq(name, tokens):
    return Sequence(name, list(tokens), SamplingParams())


def refs(kv):
    return [b.ref_count for b in kv.blocks]


def computed(kv, s, n):
    s.num_computed_tokens = n
    kv.cache_full_blocks(s)


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert q.block_ids() == [2, 0, 1, 3]
    assert q.popleft().block_id == 2
    assert len(q) == 3


def test_allocation_takes_blocks_in_order_and_is_all_or_nothing():
    kv = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", range(10))
    assert kv.allocate(a, 10)
    assert a.block_table == [0, 1, 2]
    b = seq("b", range(100, 110))
    assert not kv.allocate(b, 10)  # needs 3, one left
    assert b.block_table == [] and kv.num_free_blocks == 1
    a.num_computed_tokens = 10
    assert kv.allocate(a, 2)  # 12 tokens still fit in 3 blocks
    assert a.block_table == [0, 1, 2]
    assert kv.allocate(a, 3)  # 13..15 need a fourth
    assert a.block_table == [0, 1, 2, 3]
    assert kv.usage == 1.0


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = BlockManager(num_blocks=6, block_size=4)
    a = seq("a", range(10))
    assert kv.allocate(a, 10)
    computed(kv, a, 10)
    b = seq("b", list(range(8)) + [100, 101, 102])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert kv.allocate(b, 3, hits)
    assert b.block_table == [0, 1, 3]
    assert refs(kv) == [2, 2, 1, 1, 0, 0]


def test_prefix_hit_never_covers_the_last_prompt_token():
    kv = BlockManager(num_blocks=6, block_size=4)
    a = seq("a", range(8))
    kv.allocate(a, 8)
    computed(kv, a, 8)
    same = seq("same", range(8))
    assert [h.block_id for h in kv.find_cached_prefix(same)] == [0]  # block 1 holds the last token


def test_freed_blocks_keep_content_and_are_evicted_tail_first():
    kv = BlockManager(num_blocks=6, block_size=4)
    a = seq("a", range(10))
    kv.allocate(a, 10)
    computed(kv, a, 10)  # blocks 0, 1 named; 2 partial
    b = seq("b", list(range(8)) + [100, 101, 102])
    kv.allocate(b, 3, kv.find_cached_prefix(b))
    kv.free(a)
    assert refs(kv) == [1, 1, 0, 1, 0, 0]
    assert kv.free_queue.block_ids() == [2, 4, 5]  # unnamed block first in line
    kv.free(b)
    assert kv.free_queue.block_ids() == [3, 2, 4, 5, 1, 0]  # named tail block before its parent
    assert kv.num_free_blocks == 6
    # a request with the same prefix revives the freed named blocks from the queue
    c = seq("c", list(range(8)) + [7])
    hits = kv.find_cached_prefix(c)
    assert [h.block_id for h in hits] == [0, 1]
    assert kv.allocate(c, 1, hits)
    assert c.block_table == [0, 1, 3]
    assert kv.free_queue.block_ids() == [2, 4, 5]
    kv.free(c)
    # needing five fresh blocks evicts unnamed ones first, then block 1 (a tail), keeping 0
    d = seq("d", range(200, 220))
    assert kv.allocate(d, 20)
    assert d.block_table == [3, 2, 4, 5, 1]
    assert kv.blocks[1].block_hash is None and kv.blocks[0].block_hash is not None
    e = seq("e", list(range(8)) + [9])
    assert [h.block_id for h in kv.find_cached_prefix(e)] == [0]


def test_prefix_caching_disabled_never_hits():
    kv = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = seq("a", range(10))
    kv.allocate(a, 10)
    computed(kv, a, 10)
    assert kv.find_cached_prefix(seq("b", range(10))) == []


def test_hit_rate_counts_recorded_lookups():
    kv = BlockManager(num_blocks=4, block_size=4)
    kv.record_prefix_lookup(10, 0)
    kv.record_prefix_lookup(10, 8)
    assert kv.prefix_hit_rate == pytest.approx(0.4)


def test_identical_blocks_computed_twice_keep_the_first_name():
    kv = BlockManager(num_blocks=6, block_size=4)
    a, b = seq("a", range(6)), seq("b", range(6))
    kv.allocate(a, 6)
    kv.allocate(b, 6)
    computed(kv, a, 6)
    computed(kv, b, 6)
    assert kv.blocks[0].block_hash is not None and kv.blocks[2].block_hash is None
    kv.free(a)
    kv.free(b)
    assert kv.free_queue.block_ids() == [2, 3, 1, 4, 5, 0]
