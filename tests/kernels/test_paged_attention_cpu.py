"""The CPU attention (kernels/cpu/paged_attention.py) vs the torch reference.

Fresh seeded random ragged batches (tests/kernels/paged_batch.py: the caches the CPU
attention reads hold NaN in every slot past a sequence's end and behind every padding
entry of the block tables). Bounds, max |out - ref| / max |ref| (paged_batch.TOL):
float32 1e-4, bfloat16 / float16 2e-2. Measured over the matrix below: float32 5e-8 to
1.5e-6, bfloat16 6e-4 to 6e-3, float16 7e-4 (both sides round: the reference sends prefill
chunks through SDPA's math kernel, this module through its flash kernel, and merges
split-KV partials). fp8 KV, against the reference on the same quantized cache: same
bounds (measured 2.3e-6 float32, 2.8e-3 bfloat16).
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from pagedserve.backend.attention import (
    TORCH_KERNELS,
    AttentionMetadata,
    LayerKVCache,
    attention,
    select_attention_kernels,
)
from pagedserve.backend.errors import ConfigError
from pagedserve.kernels import dispatch
from pagedserve.kernels.cache_write import write_kv_cache_ref
from pagedserve.kernels.cpu.cache_write import write_kv_cache_cpu
from pagedserve.kernels.paged_attention import paged_attention_ref
from pagedserve.kernels.cpu.paged_attention import (
    CHUNK_KEYS,
    build_plan,
    choose_chunk_keys,
    paged_attention_cpu,
    paged_attention_cpu_batch_invariant,
    step_plan,
)

from pagedserve.kernels.cpu.paged_decode import native_decode

from .paged_batch import FP8, TOL, Batch, rel_err

CPU = torch.device("cpu")
HEADS = {"mha": (4, 4), "gqa3": (9, 3), "gqa4": (8, 2)}  # (num_heads, num_kv_heads)


def ragged(kind: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) of one batch kind; contexts cross chunk and block boundaries."""
    if kind == "decode":
        seq_lens = [1, 16, 128, 129, 256, 700] + [rng.randint(1, 600) for _ in range(6)]
        return [1] * len(seq_lens), seq_lens
    if kind == "prefill":
        q_lens = [2, 31] + [rng.randint(3, 300) for _ in range(2)]
        return q_lens, list(q_lens)
    if kind == "prefix":  # new chunks after a cached prefix (prefix hit or chunked prefill)
        q_lens = [2] + [rng.randint(3, 64) for _ in range(3)]
        return q_lens, [q + rng.randint(1, 600) for q in q_lens]
    full, chunk = rng.randint(2, 200), rng.randint(2, 40)
    pairs = [(1, rng.randint(1, 900)) for _ in range(5)] + [(full, full), (chunk, chunk + rng.randint(1, 500))]
    rng.shuffle(pairs)
    return [q for q, _ in pairs], [s for _, s in pairs]


def batch(kind: str, heads: str, head_dim: int, block_size: int, dtype: torch.dtype, **kwargs) -> Batch:
    seed = zlib.crc32(f"{kind} {heads} {head_dim} {block_size} {dtype}".encode())
    q_lens, seq_lens = ragged(kind, random.Random(seed))
    return Batch(q_lens, seq_lens, *HEADS[heads], head_dim, block_size=block_size, dtype=dtype, seed=seed,
                 device=CPU, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("kind", ["decode", "prefill", "prefix", "mixed"])
@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "torch-ops"])
def test_matches_reference(kind, heads, head_dim, block_size, dtype, native):
    b = batch(kind, heads, head_dim, block_size, dtype)
    assert rel_err(b.run(paged_attention_cpu, native=native), b.reference()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "torch-ops"])
def test_a_softmax_scale_of_the_model_s_own(native, dtype):
    """Granite's attention_multiplier in place of 1/sqrt(head_dim): the scale passed is the one applied."""
    b = batch("mixed", "gqa4", 64, 16, dtype)
    b.scale = 0.3
    assert rel_err(b.run(paged_attention_cpu, native=native), b.reference()) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 50, 128, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "torch-ops"])
def test_sliding_window(kind, dtype, window, native):
    """Mistral / Gemma's local layers: the reference's window, on the C loops and the torch ops,
    for windows inside a block, at a split boundary and longer than some contexts."""
    b = batch(kind, "gqa4", 64, 16, dtype)
    ref = paged_attention_ref(*b.ref_args(), window=window)
    assert rel_err(b.run(paged_attention_cpu, native=native, window=window), ref) < TOL[dtype]


@pytest.mark.parametrize("chunk_keys", [None, 32])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_a_windowed_decode_reads_no_key_outside_its_window(chunk_keys, kv):
    """Keys before the window hold NaN: a decode that read one would return NaN (the C loop,
    the torch-op split layout, an fp8 cache)."""
    window = 40
    b = Batch([1] * 5, [300, 41, 17, 129, 64], 8, 2, 64, dtype=torch.bfloat16, seed=3, device=CPU,
              kv_dtype=FP8 if kv == "fp8" else None)
    ref = paged_attention_ref(*b.ref_args(), **b.scales(), window=window)
    for table, length in zip(b.block_tables.tolist(), b.seq_lens.tolist()):
        for position in range(max(0, length - window)):
            for cache in (b.key_cache, b.value_cache):
                row = cache[table[position // 16], position % 16]
                row.view(torch.uint8).fill_(0x7F) if kv == "fp8" else row.fill_(float("nan"))
    out = b.run(paged_attention_cpu, window=window, chunk_keys=chunk_keys, native=chunk_keys is None)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_float16_and_head_dim_80():
    b = batch("mixed", "gqa4", 80, 16, torch.float16)
    assert rel_err(b.run(paged_attention_cpu), b.reference()) < TOL[torch.float16]


@pytest.mark.parametrize("chunk_keys", [CHUNK_KEYS, 2 * CHUNK_KEYS, 8 * CHUNK_KEYS])
def test_split_sizes_agree(chunk_keys):
    """Split-KV with one, two or many chunks per decode: same result (the merge is exact
    up to rounding); 8 * CHUNK_KEYS covers every context here, so nothing is merged."""
    b = batch("decode", "gqa3", 64, 16, torch.float32)
    assert rel_err(b.run(paged_attention_cpu, chunk_keys=chunk_keys, native=False), b.reference()) < TOL[torch.float32]


def test_full_chunks_need_no_mask():
    """Contexts that are whole chunks: no key mask, one merge across two chunks."""
    b = Batch([1, 1], [CHUNK_KEYS, 2 * CHUNK_KEYS], 9, 3, 64, seed=3, device=CPU)
    plan = build_plan(b.block_tables, b.seq_lens, b.query_start_loc, 16, CHUNK_KEYS)
    assert plan.decode.split.key_valid is None and plan.decode.split.max_chunks == 2
    assert rel_err(b.run(paged_attention_cpu, chunk_keys=CHUNK_KEYS, native=False), b.reference()) < TOL[torch.float32]


def test_chunk_choice():
    """Split when padding to the longest context would read much more; else one chunk each."""
    ragged_lens = torch.tensor([40, 90, 600, 120, 30])
    even_lens = torch.tensor([500, 510, 512, 490])
    assert choose_chunk_keys(ragged_lens) == CHUNK_KEYS
    assert choose_chunk_keys(even_lens) == 4 * CHUNK_KEYS
    assert choose_chunk_keys(torch.tensor([1])) == CHUNK_KEYS
    assert choose_chunk_keys(even_lens, requested=100 * CHUNK_KEYS) == 4 * CHUNK_KEYS  # never past the longest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kv(dtype):
    """float8_e4m3fn cache with per-tensor scales (kv_std 3 so the scales are not 1)."""
    b = batch("mixed", "gqa4", 128, 16, dtype, kv_dtype=FP8, kv_std=3.0)
    assert b.k_scale != 1.0 and b.v_scale != 1.0
    assert rel_err(b.run(paged_attention_cpu), b.reference()) < TOL[dtype]


def test_fp8_scales_ignored_for_other_dtypes():
    b = Batch([1, 3], [50, 20], 4, 2, 64, seed=3, device=CPU)
    base = b.run(paged_attention_cpu)
    assert torch.equal(paged_attention_cpu(*b.args(), k_scale=7.0, v_scale=0.1), base)


def test_empty_batch_and_shape_check():
    b = Batch([1], [1], 4, 1, 64, seed=1, device=CPU)
    empty = paged_attention_cpu(b.query[:0], *b.args()[1:3], b.block_tables[:0], b.seq_lens[:0],
                                b.query_start_loc[:1], b.scale)
    assert empty.shape == (0, 4, 64)
    with pytest.raises(ValueError):
        paged_attention_cpu(b.query[..., :32], *b.args()[1:])


def test_plan_is_built_once_per_step():
    """Every layer of a step passes the same metadata: one plan. Metadata refilled in place
    through numpy (torch's version counter does not see it) or another block size: a new one."""
    table = np.array([[3, 5]], dtype=np.int32)
    seq_lens, starts = torch.tensor([20], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    tables = torch.from_numpy(table)
    first = step_plan(tables, seq_lens, starts, 16)
    assert step_plan(tables, seq_lens, starts, 16) is first
    table[0, 1] = 7
    refilled = step_plan(tables, seq_lens, starts, 16)
    assert refilled is not first and int(refilled.decode.split.slots[19]) == 7 * 16 + 3
    assert step_plan(tables, seq_lens, starts, 32) is not refilled


def test_dispatch():
    assert dispatch.attention_kernels("auto", CPU) == (write_kv_cache_cpu, paged_attention_cpu)
    assert dispatch.attention_kernels("cpu", CPU) == (write_kv_cache_cpu, paged_attention_cpu)
    assert dispatch.attention_kernels("torch", CPU) == (write_kv_cache_ref, paged_attention_ref)
    with pytest.raises(ValueError):
        dispatch.attention_kernels("cpu", torch.device("cuda"))
    with pytest.raises(ConfigError):
        select_attention_kernels("cpu", torch.device("cuda"))


def test_engine_attention_call():
    """backend/attention.attention(): write the step's K/V into the cache, then attend,
    the CPU attention vs the reference kernels."""
    q_lens, seq_lens = [1, 6, 1, 40], [60, 6, 300, 90]
    b = Batch(q_lens, seq_lens, 9, 3, 64, seed=21, device=CPU)
    g = torch.Generator().manual_seed(22)
    key, value = (torch.randn(sum(q_lens), 3, 64, generator=g) for _ in range(2))
    slots = torch.tensor([int(b.block_tables[i, pos // 16]) * 16 + pos % 16
                          for i, (q, s) in enumerate(zip(q_lens, seq_lens)) for pos in range(s - q, s)])
    outs = []
    for kernels, k_cache, v_cache, table in (
        (TORCH_KERNELS, b.ref_key_cache, b.ref_value_cache, b.ref_block_tables),
        (select_attention_kernels("cpu", CPU), b.key_cache, b.value_cache, b.block_tables),
    ):
        meta = AttentionMetadata(slots, table, b.seq_lens, b.query_start_loc, max_query_len=40, max_seq_len=300)
        outs.append(attention(kernels, b.query, key, value, LayerKVCache(k_cache.clone(), v_cache.clone()), meta, b.scale))
    assert rel_err(outs[1], outs[0]) < TOL[torch.float32]


def test_a_step_the_c_decode_runs_never_builds_the_split_layout():
    """The split-KV layout is the torch-op decode's alone: the C decode's step does without it."""
    if native_decode() is None:
        pytest.skip("the C decode is not built here")
    b = Batch([1, 1, 1], [40, 300, 77], 9, 3, 64, seed=5, device=CPU)
    plan = step_plan(b.block_tables, b.seq_lens, b.query_start_loc, 16)
    assert rel_err(b.run(paged_attention_cpu), b.reference()) < TOL[torch.float32]
    assert step_plan(b.block_tables, b.seq_lens, b.query_start_loc, 16) is plan  # the plan the step ran
    assert "split" not in vars(plan.decode)


@pytest.mark.bit_exact("cpu")
@pytest.mark.parametrize("head_dim, window, dtype", [(64, None, torch.bfloat16), (16, None, torch.float32),
                                                     (64, 300, torch.float32), (128, None, torch.float16)], ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "torch-ops"])
def test_batch_invariant_rows_are_the_same_alone_beside_others_and_chunked(head_dim, window, dtype, native):
    """`deterministic`'s form: a 1,100-token prompt's last 600 (past the C prefill's reach at head dim
    64, where the default sends a chunk to SDPA whose blocking follows its length) and a decode give
    the same bits in a mixed batch, alone, and (the prompt) cut into 250 + 350 tokens; at head dim
    16 (SDPA's), under a window, a float16 cache (the torch-op decode), and on the torch ops, each
    within the reference's bound."""
    q_lens, seq_lens = [1, 600, 7, 1, 40], [300, 1100, 7, 2000, 900]
    b = Batch(q_lens, seq_lens, 8, 2, head_dim, dtype=dtype, seed=head_dim, device=CPU)
    attend = dict(window=window, native=native)
    whole = paged_attention_cpu_batch_invariant(*b.args(), **attend)
    ref = paged_attention_ref(*b.ref_args(), window=window)
    assert rel_err(whole, ref) < TOL[dtype]
    for i in (1, 3):
        assert torch.equal(paged_attention_cpu_batch_invariant(*b.one_sequence(i), **attend), whole[b.rows_of(i)])
    chunks = [paged_attention_cpu_batch_invariant(*b.one_sequence(1, lo, hi), **attend) for lo, hi in ((0, 250), (250, 600))]
    assert torch.equal(torch.cat(chunks), whole[b.rows_of(1)])
    with pytest.raises(ValueError, match="soft-capped"):
        paged_attention_cpu(*b.args(), softcap=30.0, batch_invariant=True)
