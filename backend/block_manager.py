"""BlockManager: the paged KV cache's bookkeeping (which physical block holds what).

Blocks have a fixed number of token slots. Each sequence owns a block table
(logical -> physical). Full blocks are named by a chained content hash (parent
hash + token ids), so a later prompt starting with the same tokens reuses them.
Freed blocks keep their hash and wait in an LRU free queue; they are evicted
only when a fresh block is needed and none without content is left. With
kv_events_config set, naming and evicting are recorded for routers (kv_events.py).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence as Seq

from pagedserve.kernels.numerics import cdiv

from .sequence import Sequence

if TYPE_CHECKING:
    from .kv_events import KVEventRecorder


def hash_block(parent: bytes | None, token_ids: Iterable[int], extra: bytes = b"") -> bytes:
    """Content hash of a full block, chained to its parent so equal blocks at
    different prefixes get different names. 128-bit blake2b: collisions are not
    a practical concern, unlike Python's predictable hash(). `extra`: what else
    the block's keys and values depend on (the images whose tokens it holds)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if extra:
        digest.update(b"extra:" + extra)
    return digest.digest()


def _salt(seq: Sequence) -> bytes | None:
    """What a sequence's first block hash starts from: its LoRA adapter's name (the same tokens
    through another adapter have other keys and values), nothing for the base model."""
    name = seq.params.lora_name
    return None if name is None else b"lora:" + name.encode()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks, eviction order first.

    O(1) popleft, append, appendleft, and removal from the middle (a free block
    revived by a prefix hit leaves the queue wherever it is).
    """

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    # A queued block and the two sentinels always have both links; None marks a block outside the queue.
    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None
        if block is self._tail:
            raise IndexError("no free KV block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, after = block.prev_free, block.next_free
        assert prev is not None and after is not None, "the block is not in the free queue"
        prev.next_free = after
        after.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        assert self._tail.prev_free is not None
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        after = anchor.next_free
        assert after is not None
        block.prev_free = anchor
        block.next_free = after
        after.prev_free = block
        anchor.next_free = block
        self._len += 1

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.events: KVEventRecorder | None = None
        """Where named and evicted blocks are recorded for routers (kv_events_config), else None."""

    # -- state -----------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any sequence (cached-but-free ones included)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / len(self.blocks)

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    # -- prefix cache ----------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Cached blocks matching the start of seq's tokens.

        Never covers the last token: its logits are needed, so at least one
        token is always computed.
        """
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, num_full)
        hits: list[KVBlock] = []
        for block_hash in seq.block_hashes[:num_full]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_query_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the seq's blocks that are now full of computed tokens by their hash (only
        of tokens whose ids are known: a pending one is named once it arrives). Blocks
        named before are not looked at again (`seq.num_named_blocks`)."""
        if not self.enable_prefix_caching or seq.num_computed_tokens // self.block_size <= seq.num_named_blocks:
            return  # no block newly full (most steps)
        num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size, len(seq.block_table))
        if num_full <= seq.num_named_blocks:
            return
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_named_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash not in self.cached_blocks:  # a twin computed earlier keeps the name
                self.cached_blocks[block_hash] = block
                block.block_hash = block_hash
                if self.events is not None:
                    size = self.block_size
                    self.events.stored(block_hash, seq.block_hashes[index - 1] if index else None,
                                       seq.token_ids[index * size : (index + 1) * size], seq.params.lora_name,
                                       _extra_keys(seq, index * size, (index + 1) * size))
        seq.num_named_blocks = num_full

    def _extend_hashes(self, seq: Sequence, num_full: int) -> None:
        size = self.block_size
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[index - 1] if index else _salt(seq)
            extra = seq.mm.hash_key(index * size, (index + 1) * size) if seq.mm is not None else b""
            seq.block_hashes.append(hash_block(parent, seq.token_ids[index * size : (index + 1) * size], extra))

    # -- allocation ------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `allocate(seq, num_new_tokens)` would take (no cached prefix)."""
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table))

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_prefix: Seq[KVBlock] = ()
    ) -> bool:
        """Give seq slots for its computed tokens, cached_prefix and num_new_tokens more.

        All or nothing: returns False and changes nothing when blocks run out.
        """
        if not cached_prefix and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True  # room in its blocks already: most decode steps
        num_tokens = seq.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(seq.block_table) - len(cached_prefix)
        num_revived = sum(1 for block in cached_prefix if block.ref_count == 0)
        if num_needed > len(self.free_queue) - num_revived:
            return False
        for block in cached_prefix:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(max(num_needed, 0)):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Named blocks queue at the tail (tail blocks of the
        sequence first, so they are evicted first); unnamed ones go to the head,
        to be reused before any cached content is evicted."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_named_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks seq's first num_tokens need (speculative decoding's rejected
        drafts); the rest are freed as `free` frees them. The table is a new list: the decode
        graphs notice a changed table by its identity (backend/cuda_graphs.py)."""
        keep = cdiv(num_tokens, self.block_size)
        if keep >= len(seq.block_table):
            return
        self._release(seq.block_table[keep:])
        seq.block_table = seq.block_table[:keep]
        seq.num_named_blocks = min(seq.num_named_blocks, keep)

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, the last first; a block no one holds joins the free
        queue: at its tail when named (evicted last, its content reusable), at its head otherwise."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their content)."""
        for block in self.blocks:
            if block.ref_count == 0:
                self._evict(block)


def _extra_keys(seq: Sequence, start: int, end: int) -> tuple | None:
    """A block's keys besides its tokens, as vLLM's KV events name them: the content hashes (hex) of
    the images with a token among positions [start, end), then the LoRA adapter's name; None: none."""
    images = [image.content_hash.hex() for image in seq.mm.overlapping(start, end)] if seq.mm is not None else []
    keys = tuple(images) + ((seq.params.lora_name,) if seq.params.lora_name is not None else ())
    return keys or None
