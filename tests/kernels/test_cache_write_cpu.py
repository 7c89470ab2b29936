"""The C KV cache write (kernels/cpu/cache_write.py) against the torch reference: the same
cache bytes, from K/V that are views of the fused projection as the model passes them."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu import cache_write as cache_write_cpu
from pagedserve.kernels.cache_write import write_kv_cache_ref
from pagedserve.kernels.numerics import FP8_DTYPE

built = pytest.mark.skipif(cache_write_cpu.LIBRARY.get() is None, reason="the C cache write is not built here")
BLOCKS, BLOCK, KV_HEADS, DIM = 12, 16, 3, 64


def projection(tokens: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as views of one [tokens, (9 + 2 * 3) heads] projection, as the model slices them."""
    qkv = torch.randn(tokens, (9 + 2 * KV_HEADS) * DIM, generator=g).to(dtype)
    k = qkv[:, 9 * DIM : (9 + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    return k, qkv[:, (9 + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)


def both(key, value, slots, dtype=None):
    """(C write, reference write) into fresh caches of the key's dtype (or `dtype`)."""
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM, dtype=dtype or key.dtype) for _ in range(4)]
    cache_write_cpu.write_kv_cache_cpu(key, value, caches[0], caches[1], slots, k_scale=1.0, v_scale=1.0)
    write_kv_cache_ref(key, value, caches[2], caches[3], slots, k_scale=1.0, v_scale=1.0)
    return caches


@built
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 100])
def test_same_cache_as_the_reference(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    key, value = projection(tokens, dtype, g)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:tokens]
    slots[1::3] = -1  # padding rows: skipped
    ck, cv, rk, rv = both(key, value, slots)
    assert torch.equal(ck, rk) and torch.equal(cv, rv) and ck.abs().sum() > 0


@built
def test_a_slot_past_the_cache_is_refused_and_nothing_is_written():
    key, value = projection(3, torch.float32, torch.Generator().manual_seed(0))
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2)]
    with pytest.raises(IndexError, match="past the cache"):
        cache_write_cpu.write_kv_cache_cpu(key, value, *caches, torch.tensor([0, 5, BLOCKS * BLOCK]))
    assert caches[0].abs().sum() == 0


def test_what_it_does_not_take_goes_to_the_reference():
    """An fp8 cache (quantized with its scale) and int32 slots: the reference's result."""
    key, value = projection(5, torch.float32, torch.Generator().manual_seed(1))
    slots = torch.arange(5)
    ck, cv, rk, rv = both(key, value, slots, dtype=FP8_DTYPE)
    assert torch.equal(ck.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(cv.view(torch.uint8), rv.view(torch.uint8))
    ck, cv, rk, rv = both(key, value, slots.int())
    assert torch.equal(ck, rk) and torch.equal(cv, rv)
