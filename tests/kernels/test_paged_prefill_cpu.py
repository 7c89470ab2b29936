"""The C prefill attention (kernels/cpu/paged_prefill.py) against the torch reference.

Prefill chunks of every kind a step holds (a fresh prompt, the rest of a prompt after its
cached prefix, one token past a prefix, whole and partial 16-key tiles) over NaN-poisoned
caches (tests/kernels/paged_batch.py: a read past a sequence's end shows as NaN), float32
and bfloat16, within paged_batch.TOL (float32 1e-4; measured ~3e-7), in the CPU's own code and in
the other ISA variants' (AVX2, AVX-512, AVX512-BF16: emulated by SIMDe where the CPU lacks
them). Runs where the C loop is built (AVX2 or AVX-512); elsewhere the library is not used
(tests/kernels/test_native_build.py) and SDPA's results are checked instead.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import paged_prefill as paged_prefill_cpu
from pagedserve.kernels.cpu.paged_attention import build_plan, native_prefill_max_keys, paged_attention_cpu

from .instruction_sets import use_variant
from .paged_batch import TOL, Batch, rel_err

CPU = torch.device("cpu")


def prefill_batch(heads: int, kv_heads: int, head_dim: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Batch:
    limit = native_prefill_max_keys(head_dim)
    q_lens = [1, 17, 16, 130, 40, 7, 300]
    seq_lens = [1, 17, 48, 130, min(333, limit), limit, limit + 200]  # the last goes to SDPA
    return Batch(q_lens, seq_lens, heads, kv_heads, head_dim, seed=seed, device=CPU, dtype=dtype)


SHAPES = [(heads, kv_heads, head_dim) for head_dim in (64, 128) for heads, kv_heads in [(9, 3), (8, 2), (4, 4), (32, 4)]]
CASES = [pytest.param(variant, *shape, id=f"{variant}-{shape[2]}-{shape[0]}-{shape[1]}")
         for variant in ("native", "avx2", "avx512", "avx512bf16") for shape in SHAPES
         if variant in ("native", "avx2") or shape in ((9, 3, 64), (32, 4, 128))]  # AVX-512 (often emulated): two


@pytest.mark.parametrize("variant, heads, kv_heads, head_dim", CASES)
def test_prefill_chunks_match_the_reference(variant, heads, kv_heads, head_dim, monkeypatch):
    use_variant(monkeypatch, variant)
    b = prefill_batch(heads, kv_heads, head_dim, seed=heads + head_dim)
    assert rel_err(b.run(paged_attention_cpu), b.reference()) < TOL[torch.float32]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (32, 4, 128)])
def test_bfloat16_chunks_match_the_reference(heads, kv_heads, head_dim, instruction_set):
    """bf16 queries and caches: read as float32, summed in float32, rounded once on output."""
    b = prefill_batch(heads, kv_heads, head_dim, seed=heads, dtype=torch.bfloat16)
    out = b.run(paged_attention_cpu)
    assert out.dtype == torch.bfloat16 and rel_err(out, b.reference()) < TOL[torch.bfloat16]


def test_the_c_loop_computes_the_short_chunks_and_leaves_long_ones(instruction_set):
    b = prefill_batch(9, 3, 64)
    plan = build_plan(b.block_tables, b.seq_lens, b.query_start_loc, 16)
    chunks, rest = plan.native_prefills(64)
    assert chunks.q_lens.tolist() == [17, 16, 130, 40, 7] and [p.end - p.start for p in rest] == [300]
    function = paged_prefill_cpu.native_prefill()
    if function is None:
        pytest.skip("the C prefill is not built here (no C compiler, or no AVX2: SDPA runs, checked above)")
    out = torch.full_like(b.query, float("nan"))
    assert paged_prefill_cpu.paged_prefill(function, b.query, b.key_cache, b.value_cache, out, chunks, b.scale)
    reference = b.reference()
    for start, length in zip(chunks.q_starts.tolist(), chunks.q_lens.tolist()):
        rows = slice(start, start + length)
        assert rel_err(out[rows], reference[rows]) < TOL[torch.float32]
    assert out[-300:].isnan().all()  # the long chunk is not the C loop's


def test_declines_what_it_does_not_compute():
    b = prefill_batch(9, 3, 64)
    assert paged_prefill_cpu.supports(b.query.bfloat16(), b.key_cache.bfloat16())
    assert not paged_prefill_cpu.supports(b.query.half(), b.key_cache.half())
    assert not paged_prefill_cpu.supports(b.query, b.key_cache.bfloat16())
    assert not paged_prefill_cpu.supports(b.query, b.key_cache.transpose(1, 2))  # not contiguous
