"""Paged attention for CPU: the Triton kernel's work split, in torch ops that are fast on CPU.

Past 300 lines on purpose: the step plan (built once per step, shared by every layer), the
dispatch to the C loops and the torch-op paths they fall back to read the same plan fields
and change together; split, each part would reach into the others' dataclasses.

Same signature and layout as `paged_attention_ref` (kernels/paged_attention.py), which
stays the test oracle and the `attention_backend: torch` choice; `auto` picks this one
on CPU (kernels/dispatch.py).

Where the reference loses time on CPU, and what this module does instead:
- Prefill chunks: the reference hands SDPA 3-D tensors, which torch's CPU dispatcher
  sends to the math kernel (scores materialised; slower than the flash kernel it picks for
  4-D inputs, far slower in bfloat16: benchmarks/RESULTS.md, "CPU paged attention"). Here:
  one 4-D flash SDPA per sequence with enable_gqa;
  `is_causal` when the chunk has no cached prefix, else an additive lower-right causal
  mask built once per step.
- Decodes (query_len 1): the reference pads every decode to the batch's longest context
  and gathers K and V at that size. Here: split-KV (flash-decoding) over chunks of
  CHUNK_KEYS keys when the contexts are ragged enough to make padding cost more than
  the merge (`choose_chunk_keys`). Every chunk of every decode is one batch row of a
  single flash call (GQA folded into query rows, as in the Triton kernel's tiles), its
  K/V rows gathered by slot from the sequence's own blocks only (no padding past a chunk,
  never a read of a slot beyond the sequence's end); the chunks' partial outputs are
  merged with their log-sum-exp, the Triton kernel's split reduce.
- Index tensors and masks depend only on the step's metadata, which every layer shares:
  they are built once per step (`step_plan`: the last plan is reused while the metadata
  is equal), not once per layer.

Prefill chunks of a float32 cache go first, all of a step's at once, to the C loop in
kernels/cpu/paged_prefill.py (AVX-512 machines), which reads each chunk's keys in place;
SDPA per chunk runs where it is not built or declines, and with native=False.
Decodes of float32 and bfloat16 caches go first to the C loop in
kernels/cpu/paged_decode.py, which reads each key and value row once, in place, through
the block table. The torch-op decode below is what runs where that loop is not built (no
C compiler), for float16 and fp8 caches, and with native=False. It copies K/V rows by
`index_select` (only the rows a step reads) before the flash kernel reads them: torch has
no CPU matmul that reads through a block table (benchmarks/RESULTS.md, "CPU paged
attention", for the torch-op variants measured).

The decode path calls `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`, the
op behind CPU flash SDPA, for its log-sum-exp (the public SDPA does not return it).
FP8 KV cache: the gathered rows are dequantized (stored * scale, in float32, then the
query dtype), as the reference does.

Sliding window (`window`): the step's plan gets a windowed twin (`StepPlan.windowed`, built
once a step for each window size the layers ask for). A decode past the window reads its
last `window` keys through a table of their slots (block size 1 to the C loop and the
split layout alike), so it reads no key outside the window; a prefill chunk past the window
keeps only the keys its first token's window starts at and takes a banded mask (SDPA: the C
prefill has no window and takes only chunks the window does not cut).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..numerics import cdiv
from ..paged_attention import is_fp8, kv_scales, paged_attention_ref, visible_keys
from .paged_decode import native_decode, paged_decode, supports
from .paged_prefill import PrefillChunks, native_prefill, paged_prefill, supports as prefill_supports

CHUNK_KEYS = 128
"""Keys per decode split: measured best of 64/128/256 on SmolLM2 shapes."""
SPLIT_MIN_SAVING = 1.25
"""Split only when padding every decode to the longest context would read this many times
the keys of the split layout; below it the merge costs more than the padding saves."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def native_prefill_max_keys(head_dim: int) -> int:
    """Sequences up to this long go to the C prefill: 1024 keys at head dim 64, 256 at 128.
    Measured against SDPA (float32, 2-core Xeon). Head dim 64 (9 / 3 heads): the C loop is
    faster on 16 fresh chunks of 128 tokens, on 2 x 512 after 512 cached and on one of 2,048,
    slower on one of 4,096 and on 2,048 after 6,144. Head dim 128 (32 / 8 heads): faster on
    8 x 256, slower on 4 x 128 after 384 and at 1,024 (benchmarks/RESULTS.md, "Xeon (no AMX):
    CPU kernels" and "Figures behind design choices in the code")."""
    return 1024 * 64 * 64 // (head_dim * head_dim)


@dataclass
class SplitKV:
    """Split-KV layout of the step's decodes for the torch-op decode: each chunk reads
    chunk_keys consecutive keys of one decode; slots are cache rows (block * block_size + offset)."""

    chunk_keys: int
    chunk_tokens: torch.Tensor  # [num_chunks] query row of each chunk
    slots: torch.Tensor  # [num_chunks * chunk_keys] cache rows; past a sequence's end: its slot 0
    key_valid: torch.Tensor | None  # [num_chunks, chunk_keys]; None when every chunk is full
    merge_index: torch.Tensor | None  # [num_chunks] cell in a [num_decodes * max_chunks] grid; None: one chunk each
    max_chunks: int
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive key mask [num_chunks, 1, 1, chunk_keys] (flash wants the query dtype)."""
        if self.key_valid is None:
            return None
        if dtype not in self.masks:
            self.masks[dtype] = _additive(self.key_valid, dtype)[:, None, None, :]
        return self.masks[dtype]


@dataclass
class DecodePlan:
    """The step's decodes as the C decode reads them; the torch-op decode's split-KV layout
    (`split`) is built on first use, since a step the C code runs never needs it (building it
    every step slowed a one-sequence decode step measurably: benchmarks/RESULTS.md, "Figures
    behind design choices in the code")."""

    tokens: torch.Tensor  # [num_decodes] query rows of the decodes
    tables: torch.Tensor  # int32 [num_decodes, max_blocks]: the decodes' block-table rows
    lens: torch.Tensor  # int32 [num_decodes]
    block_size: int
    """The cache's, or 1 in a windowed plan whose tables list the window's slots."""
    requested_chunk_keys: int | None = None
    """The split size asked for (tests); None: choose_chunk_keys decides."""

    @functools.cached_property
    def split(self) -> SplitKV:
        lens = self.lens.long()
        chunk_keys = choose_chunk_keys(lens, self.requested_chunk_keys)
        return _split_kv(self.tables.long(), lens, self.tokens, self.block_size, chunk_keys)

    def windowed(self, window: int) -> DecodePlan:
        """The decodes' last `window` keys: this plan where none reads more, else tables of the
        window's slots (block size 1) and lengths capped at the window."""
        lens = self.lens.long()
        longest = int(lens.max())
        if longest <= window:
            return self
        positions = (lens - window).clamp(min=0)[:, None] + torch.arange(min(window, longest))
        positions = torch.minimum(positions, lens[:, None] - 1)  # past a short decode's end: its last key, never read
        slots = _slots(self.tables.long(), positions, self.block_size)
        return DecodePlan(self.tokens, slots.to(torch.int32), lens.clamp(max=window).to(torch.int32), 1,
                          self.requested_chunk_keys)


@dataclass
class PrefillPlan:
    """One sequence with query_len > 1: query rows [start, end), keys at `slots`."""

    start: int
    end: int
    slots: torch.Tensor  # [seq_len], or the keys from the first token's window on
    window: int | None = None
    """Set where the sliding window hides some of `slots` from some query (a windowed plan)."""
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    table: torch.Tensor | None = None
    """The sequence's block-table row (int32), for `StepPlan.as_decodes`."""

    @property
    def causal(self) -> bool:
        """No cached prefix and no window: plain causal attention over the chunk itself."""
        return self.end - self.start == self.slots.numel() and self.window is None

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Lower-right causal mask [q_len, seq_len] (query i sees keys up to seq_len - q_len + i),
        banded by the window where one is set."""
        if dtype not in self.masks:
            self.masks[dtype] = _additive(visible_keys(self.end - self.start, self.slots.numel(), self.window), dtype)
        return self.masks[dtype]

    def windowed(self, window: int) -> PrefillPlan:
        """This chunk under a sliding window: itself where no query's window cuts its keys, else
        its keys from the first query's window on, masked per query."""
        q_len, seq_len = self.end - self.start, self.slots.numel()
        if seq_len <= window:
            return self
        first = max(0, seq_len - q_len - window + 1)
        return PrefillPlan(self.start, self.end, self.slots[first:], window, table=self.table)


@dataclass
class StepPlan:
    decode: DecodePlan | None
    prefills: list[PrefillPlan]
    chunks: tuple[int, PrefillChunks | None, list[PrefillPlan]] | None = None
    """(head dim, the C prefill's chunks, the rest) once `native_prefills` built them."""
    windows: dict[int, StepPlan] = field(default_factory=dict)
    row_decodes: dict[int | None, DecodePlan] = field(default_factory=dict)
    """`as_decodes`' plans, by window."""
    block_size: int = 0
    """The cache's (the block tables' unit)."""

    def windowed(self, window: int | None) -> StepPlan:
        """This step under a sliding window (the plan itself for None), built once per window size."""
        if window is None:
            return self
        if window < 1:
            raise ValueError(f"window={window}: a sliding window holds at least one key")
        if window not in self.windows:
            decode = None if self.decode is None else self.decode.windowed(window)
            self.windows[window] = StepPlan(decode, [p.windowed(window) for p in self.prefills], block_size=self.block_size)
        return self.windows[window]

    def as_decodes(self, window: int | None, chunk_keys: int | None) -> DecodePlan:
        """Every query row of the step's prefill chunks as a decode of the keys up to its own (its
        sequence's block-table row, repeated), under `window` (this plan must be the unwindowed
        one): `batch_invariant`'s route for prefills. Built once a step."""
        if window not in self.row_decodes:
            rows, tables, lens = [], [], []
            for p in self.prefills:
                assert p.table is not None  # build_plan sets it
                q_len, seq_len = p.end - p.start, p.slots.numel()
                rows.append(torch.arange(p.start, p.end))
                tables.append(p.table.expand(q_len, -1))
                lens.append(torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32))
            plan = DecodePlan(torch.cat(rows), torch.cat(tables).contiguous(), torch.cat(lens), self.block_size, chunk_keys)
            self.row_decodes[window] = plan if window is None else plan.windowed(window)
        return self.row_decodes[window]

    def native_prefills(self, head_dim: int) -> tuple[PrefillChunks | None, list[PrefillPlan]]:
        """The prefills the C loop takes, in its layout (built once a step, on first use), and
        those it leaves to SDPA (sequences longer than native_prefill_max_keys)."""
        if self.chunks is None or self.chunks[0] != head_dim:
            limit = native_prefill_max_keys(head_dim)
            takes = [p.slots.numel() <= limit and p.window is None for p in self.prefills]
            short = [p for p, taken in zip(self.prefills, takes) if taken]
            chunks = (PrefillChunks.of([p.start for p in short], [p.end for p in short], [p.slots for p in short])
                      if short else None)
            self.chunks = (head_dim, chunks, [p for p, taken in zip(self.prefills, takes) if not taken])
        return self.chunks[1], self.chunks[2]


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_seq_len: int | None = None,
    chunk_keys: int | None = None,
    native: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """CPU twin of `paged_attention_ref` (same arguments, the sliding window included; max_seq_len
    is not needed). Soft-capped scores (Gemma 2) and attention sinks (gpt-oss) take the reference
    itself: neither the C loops nor torch's flash kernel have them.

    batch_invariant (`deterministic`): each query row's output the same whatever else the step
    holds and however its prompt was chunked. Every prefill row runs as a decode of the keys up to
    its own (the C decode reads one row's keys in one order whatever the batch), since which of the
    C prefill and SDPA takes a chunk depends on its length, and SDPA's blocking too; the torch-op
    decode (no C compiler, float16 or fp8 caches) splits every context into CHUNK_KEYS keys whatever
    the batch. It reads each prompt's keys once per row instead of once per 16 rows: prompts cost
    more (benchmarks/deterministic.py). Not with a soft cap or sinks.

    Keyword-only, for tests and benchmarks: chunk_keys forces the torch-op decode's split
    size (capped at the longest context rounded up to CHUNK_KEYS, which means no split);
    native=False keeps decodes and prefills on the torch ops even where the C loops are built."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[1] % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not match cache {tuple(key_cache.shape)}")
    if batch_invariant and (softcap is not None or sinks is not None):
        raise ValueError("the CPU attention has no batch-invariant form with soft-capped scores or attention sinks")
    if softcap is not None or sinks is not None:
        return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                   k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, sinks=sinks)
    out = query.new_empty(query.shape)  # contiguous even when the query is a view
    if query.shape[0] == 0:
        return out
    if batch_invariant and chunk_keys is None:
        chunk_keys = CHUNK_KEYS
    unwindowed = step_plan(block_tables, seq_lens, query_start_loc, key_cache.shape[1], chunk_keys)
    plan = unwindowed.windowed(window)
    torch_decode = plan.decode is not None and not (
        native and _native_decode(query, key_cache, value_cache, out, plan.decode, scale))
    prefills, row_decodes = plan.prefills, None
    if prefills and batch_invariant:
        row_decodes = unwindowed.as_decodes(window, chunk_keys)
        prefills = []
        if native and _native_decode(query, key_cache, value_cache, out, row_decodes, scale):
            row_decodes = None
    if prefills and native:
        prefills = _native_prefill(query, key_cache, value_cache, out, plan, scale)
    if not (torch_decode or prefills or row_decodes):  # the C loops took everything (the usual CPU step)
        return out
    ks, vs = kv_scales(key_cache, k_scale, v_scale)
    keys, values = KVRows(key_cache, ks, query.dtype), KVRows(value_cache, vs, query.dtype)
    for decode in (plan.decode if torch_decode else None, row_decodes):
        if decode is not None:
            out.index_copy_(0, decode.tokens, _decode(query, keys, values, decode, scale))
    for prefill in prefills:
        out[prefill.start : prefill.end] = _prefill(query, keys, values, prefill, scale)
    return out


class KVRows:
    """One cache as rows of [kv_heads, head_dim] by slot, read in the query dtype."""

    def __init__(self, cache: torch.Tensor, scale: float, dtype: torch.dtype):
        self.fp8 = is_fp8(cache)
        raw = cache.view(torch.uint8) if self.fp8 else cache  # index_select may lack fp8 kernels
        self.rows = raw.view(-1, cache.shape[2] * cache.shape[3])
        self.shape = cache.shape[2:]
        self.scale, self.dtype, self.cache_dtype = scale, dtype, cache.dtype

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), kv_heads, head_dim] in the query dtype."""
        rows = self.rows.index_select(0, slots).view(-1, *self.shape)
        if self.fp8:
            return (rows.view(self.cache_dtype).float() * self.scale).to(self.dtype)
        return rows.to(self.dtype)


def _native_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                   plan: DecodePlan, scale: float) -> bool:
    """The decodes by the C loop that reads the cache in place (kernels/cpu/paged_decode.py),
    when it is built and takes these dtypes; False: the caller runs the torch-op decode."""
    function = native_decode() if supports(query, key_cache) else None
    return function is not None and paged_decode(function, query, key_cache, value_cache, out, plan.tables, plan.lens,
                                                 plan.tokens, scale, plan.block_size)


def _native_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                    plan: StepPlan, scale: float) -> list[PrefillPlan]:
    """The prefill chunks the C loop that reads the cache in place (kernels/cpu/paged_prefill.py)
    takes, computed; returns those left for SDPA (all of them where it is not built or
    declines these dtypes)."""
    function = native_prefill() if prefill_supports(query, key_cache) else None
    if function is None:
        return plan.prefills
    chunks, rest = plan.native_prefills(query.shape[-1])
    if chunks is not None and not paged_prefill(function, query, key_cache, value_cache, out, chunks, scale):
        return plan.prefills
    return rest


def _decode(query: torch.Tensor, keys: KVRows, values: KVRows, decode: DecodePlan, scale: float) -> torch.Tensor:
    """All decodes: one flash call over every chunk, then the log-sum-exp merge. [num_decodes, heads, dim]"""
    plan = decode.split
    num_chunks = plan.chunk_tokens.numel()
    kv_heads, head_dim = keys.shape
    q = query.index_select(0, plan.chunk_tokens).view(num_chunks, kv_heads, -1, head_dim)
    k = keys.gather(plan.slots).view(num_chunks, plan.chunk_keys, kv_heads, head_dim).transpose(1, 2)
    v = values.gather(plan.slots).view(num_chunks, plan.chunk_keys, kv_heads, head_dim).transpose(1, 2)
    out, lse = _flash(q, k, v, attn_mask=plan.mask(query.dtype), scale=scale)[:2]
    if plan.merge_index is not None:
        out = _merge_chunks(out, lse, plan.merge_index, decode.tokens.numel(), plan.max_chunks)
    return out.reshape(-1, query.shape[1], head_dim).to(query.dtype)


def _merge_chunks(out: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, num_decodes: int, max_chunks: int) -> torch.Tensor:
    """sum_c exp(lse_c) out_c / sum_c exp(lse_c) per decode, in float32 (empty grid cells weigh 0)."""
    grid_lse = lse.new_full((num_decodes * max_chunks, *lse.shape[1:]), float("-inf")).index_copy_(0, index, lse)
    weights = torch.softmax(grid_lse.view(num_decodes, max_chunks, *lse.shape[1:]), dim=1)
    grid_out = out.new_zeros((num_decodes * max_chunks, *out.shape[1:]), dtype=torch.float32)
    grid_out.index_copy_(0, index, out.float())
    return (grid_out.view(num_decodes, max_chunks, *out.shape[1:]) * weights[..., None]).sum(1)


def _prefill(query: torch.Tensor, keys: KVRows, values: KVRows, plan: PrefillPlan, scale: float) -> torch.Tensor:
    """One sequence's chunk through 4-D flash SDPA (3-D inputs would take the math kernel)."""
    q = query[plan.start : plan.end].transpose(0, 1)[None]  # [1, heads, q_len, dim]
    k = keys.gather(plan.slots).transpose(0, 1)[None]  # [1, kv_heads, seq_len, dim]
    v = values.gather(plan.slots).transpose(0, 1)[None]
    mask = None if plan.causal else plan.mask(query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=plan.causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# ------------------------------------------------------------------------------------- step plan

class _LastPlan(threading.local):
    """The last plan built on this thread (one engine thread per model instance) and copies
    of the metadata it was built from."""

    settings: tuple = ()
    metadata: tuple = ()
    plan: StepPlan | None = None


_last = _LastPlan()


def step_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
    chunk_keys: int | None = None,
) -> StepPlan:
    """The plan for this metadata: the last one while the metadata is equal (every layer of
    one step), else a new one. Compared by value, not identity: a caller may refill the
    same tensors in place (through numpy, which torch's version counter does not see)."""
    metadata = tuple(t.numpy() for t in (block_tables, seq_lens, query_start_loc))
    settings = (block_size, chunk_keys)
    same = _last.plan is not None and settings == _last.settings and all(
        a.shape == b.shape and np.array_equal(a, b) for a, b in zip(metadata, _last.metadata)
    )
    plan = _last.plan
    if plan is None or not same:  # (`same` is False without a plan)
        plan = _last.plan = build_plan(block_tables, seq_lens, query_start_loc, block_size, chunk_keys)
        _last.settings, _last.metadata = settings, tuple(a.copy() for a in metadata)
    return plan


def build_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
    chunk_keys: int | None = None,
) -> StepPlan:
    """Split the flat batch into decodes (one batched plan) and prefill chunks (one plan each).
    In numpy: as torch ops on these few dozen numbers, building each step's plan was a cost
    the step noticed (benchmarks/RESULTS.md, "Figures behind design choices in the code")."""
    tables, lens = block_tables.numpy(), seq_lens.numpy()
    starts = query_start_loc.numpy().astype(np.int64)
    is_decode = np.diff(starts) == 1
    decode = None
    if is_decode.any():
        decode = DecodePlan(torch.from_numpy(starts[:-1][is_decode]), torch.from_numpy(tables[is_decode].astype(np.int32)),
                            torch.from_numpy(lens[is_decode].astype(np.int32)), block_size, chunk_keys)
    prefills = []
    for i in np.flatnonzero(~is_decode).tolist():
        positions = np.arange(int(lens[i]))
        slots = tables[i, positions // block_size].astype(np.int64) * block_size + positions % block_size
        prefills.append(PrefillPlan(int(starts[i]), int(starts[i + 1]), torch.from_numpy(slots),
                                    table=torch.from_numpy(tables[i].astype(np.int32))[None]))
    return StepPlan(decode, prefills, block_size=block_size)


def choose_chunk_keys(lens: torch.Tensor, requested: int | None = None) -> int:
    """Keys per decode chunk: CHUNK_KEYS when splitting saves SPLIT_MIN_SAVING in keys read,
    else one chunk per decode as long as the longest context (no merge: the reference's
    padded layout). A requested size is capped at that longest chunk."""
    longest = cdiv(int(lens.max()), CHUNK_KEYS) * CHUNK_KEYS
    if requested is not None:
        return min(requested, longest)
    split_keys = int(cdiv(lens, CHUNK_KEYS).sum()) * CHUNK_KEYS
    return CHUNK_KEYS if lens.numel() * longest > SPLIT_MIN_SAVING * split_keys else longest


def _split_kv(tables: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor, block_size: int, chunk_keys: int) -> SplitKV:
    """Chunks of chunk_keys keys per decode, in decode order; positions past a sequence's end
    read its slot 0 (finite, masked) so nothing outside its tokens is ever touched."""
    num_chunks = cdiv(lens, chunk_keys)
    first_chunk = torch.cumsum(num_chunks, 0) - num_chunks
    owner = torch.repeat_interleave(torch.arange(lens.numel()), num_chunks)
    chunk = torch.arange(owner.numel()) - first_chunk[owner]
    positions = chunk[:, None] * chunk_keys + torch.arange(chunk_keys)
    valid = positions < lens[owner][:, None]
    slots = _slots(tables.index_select(0, owner), positions * valid, block_size)
    max_chunks = int(num_chunks.max())
    return SplitKV(
        chunk_keys=chunk_keys,
        chunk_tokens=tokens[owner],
        slots=slots.reshape(-1),
        key_valid=None if bool(valid.all()) else valid,
        merge_index=owner * max_chunks + chunk if max_chunks > 1 else None,
        max_chunks=max_chunks,
    )


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache rows of token positions [n, k] through block-table rows [n, max_blocks]."""
    return tables.gather(1, positions // block_size) * block_size + positions % block_size


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere, in `dtype` (SDPA's float-mask form)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def paged_attention_cpu_batch_invariant(*args: object, **kwargs: object) -> torch.Tensor:
    """`paged_attention_cpu` with batch_invariant=True (`deterministic`): a function of its own, which
    backend/cpu/decoder_stack.py recognises (its decode-only steps are the same C decode)."""
    return paged_attention_cpu(*args, batch_invariant=True, **kwargs)  # type: ignore[arg-type]


__all__ = ["CHUNK_KEYS", "StepPlan", "build_plan", "choose_chunk_keys", "paged_attention_cpu",
           "paged_attention_cpu_batch_invariant", "step_plan"]
