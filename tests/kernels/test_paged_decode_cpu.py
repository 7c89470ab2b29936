"""The C decode attention (kernels/cpu/paged_decode.py) against the torch reference.

Decode-only ragged batches over NaN-poisoned caches (tests/kernels/paged_batch.py: any
read past a sequence's end or through a padding entry of a block table shows as NaN).
Bounds as for the CPU attention (paged_batch.TOL: float32 1e-4, bfloat16 2e-2); measured
float32 ~1e-6, bfloat16 2e-3 to 6e-3 (the query and output round to bfloat16 on both sides).
The shapes cover the AVX-512 or AVX2 specialisations (head_dim 64 / 128, groups 1-8; which one
runs depends on the CPU, the other is compiled but not run), the portable
loop (head_dim 80, group 16), both work splits (few decodes: one item per KV head; many:
one per decode), contexts of 1 key to past 2,000 and block sizes 8-32.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.kernels.cpu import paged_decode as paged_decode_cpu
from pagedserve.kernels.cpu.paged_attention import build_plan, paged_attention_cpu

from .paged_batch import TOL, Batch, rel_err

CPU = torch.device("cpu")
DECODE = paged_decode_cpu.native_decode()
needs_build = pytest.mark.skipif(DECODE is None, reason="the C decode is not built here (no C compiler)")


def decode_batch(num_decodes: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block_size: int = 16, longest: int = 700, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    lens = [1, longest] + [rng.randint(1, longest) for _ in range(num_decodes - 2)]
    return Batch([1] * num_decodes, lens, heads, kv_heads, head_dim, block_size=block_size, dtype=dtype,
                 seed=seed, device=CPU)


def run_native(b: Batch) -> torch.Tensor:
    """The C decode alone (no torch-op fallback), as paged_attention_cpu calls it."""
    plan = build_plan(b.block_tables, b.seq_lens, b.query_start_loc, b.key_cache.shape[1]).decode
    out = torch.full_like(b.query, float("nan"))
    assert paged_decode_cpu.paged_decode(paged_decode_cpu.native_decode(), b.query, b.key_cache, b.value_cache, out, plan.tables, plan.lens,
                                         plan.tokens, b.scale)
    return out


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_decodes", [3, 40], ids=["per-head-items", "per-decode-items"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64), (4, 4, 64), (8, 2, 128), (16, 2, 128), (32, 32, 64), (12, 3, 80), (16, 1, 64),
], ids=["smollm2", "mha", "llama3-gqa4", "gqa8", "mha32", "dim80-portable", "group16-portable"])
def test_matches_reference(heads, kv_heads, head_dim, num_decodes, dtype):
    b = decode_batch(num_decodes, heads, kv_heads, head_dim, dtype, seed=heads * 100 + head_dim + num_decodes)
    assert rel_err(run_native(b), b.reference()) < TOL[dtype]


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim,num_decodes", [(9, 3, 64, 3), (8, 2, 128, 40), (12, 3, 80, 3)],
                         ids=["smollm2-per-head-items", "llama3-gqa4-per-decode-items", "dim80-portable"])
def test_each_instruction_set_matches_reference(heads, kv_heads, head_dim, num_decodes, dtype, instruction_set):
    """The other ISA variants' code (AVX2, AVX-512, AVX512-BF16 pairs; emulated by SIMDe where
    the CPU lacks them): a few of the shapes above, each item form and the portable loop."""
    b = decode_batch(num_decodes, heads, kv_heads, head_dim, dtype, seed=heads * 100 + head_dim + num_decodes)
    assert rel_err(run_native(b), b.reference()) < TOL[dtype]


@needs_build
@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_and_long_contexts(block_size):
    """Contexts past 2,000 keys (the score buffer grows) across several block sizes."""
    b = decode_batch(6, 9, 3, 64, torch.bfloat16, block_size=block_size, longest=2100, seed=block_size)
    assert rel_err(run_native(b), b.reference()) < TOL[torch.bfloat16]


@needs_build
def test_large_scores_stay_finite():
    """Keys 30x the usual scale: softmax must subtract the maximum before exponentiating."""
    b = Batch([1, 1], [300, 45], 9, 3, 64, seed=5, device=CPU, kv_std=30.0)
    assert rel_err(run_native(b), b.reference()) < TOL[torch.float32]


@needs_build
def test_mixed_step_uses_it_for_decodes_only():
    """Through paged_attention_cpu: decodes from the C loop, prefill chunks from flash SDPA,
    rows of neither left untouched; equal to the torch-op decode up to rounding."""
    b = Batch([1, 37, 1, 5, 1], [260, 37, 1, 90, 513], 9, 3, 64, dtype=torch.bfloat16, seed=9, device=CPU)
    ref = b.reference()
    native, torch_ops = b.run(paged_attention_cpu), b.run(paged_attention_cpu, native=False)
    assert rel_err(native, ref) < TOL[torch.bfloat16] and rel_err(torch_ops, ref) < TOL[torch.bfloat16]


@needs_build
def test_shapes_beyond_its_buffers_fall_back():
    """A group of 64 query heads per KV head is past the C loop's buffers: it declines and
    the torch-op decode answers."""
    b = decode_batch(3, 64, 1, 64, torch.float32)
    plan = build_plan(b.block_tables, b.seq_lens, b.query_start_loc, 16).decode
    out = torch.empty_like(b.query)
    assert not paged_decode_cpu.paged_decode(DECODE, b.query, b.key_cache, b.value_cache, out, plan.tables,
                                             plan.lens, plan.tokens, b.scale)
    assert rel_err(b.run(paged_attention_cpu), b.reference()) < TOL[torch.float32]


def test_other_dtypes_take_the_torch_ops():
    b = decode_batch(4, 8, 2, 64, torch.float16)
    assert not paged_decode_cpu.supports(b.query, b.key_cache)
    assert rel_err(b.run(paged_attention_cpu), b.reference()) < TOL[torch.float16]


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_query_may_be_a_view_of_the_fused_projection(dtype):
    """The model hands attention q as a view (rows (heads + kv_heads) * head_dim apart,
    rotated together with k): read in place, same result as a contiguous copy."""
    b = decode_batch(12, 9, 3, 64, dtype, seed=11)
    fused = torch.randn(b.query.shape[0], 12, 64).to(dtype)
    fused[:, :9] = b.query
    b.query = fused[:, :9]
    assert not b.query.is_contiguous() and paged_decode_cpu.supports(b.query, b.key_cache)
    assert rel_err(run_native(b), b.reference()) < TOL[dtype]
