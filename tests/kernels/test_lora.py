"""Batched LoRA: the torch reference (kernels/lora.py) against one PEFT-ordered delta per token, and
the grouped Triton kernels (kernels/triton/lora.py) against the reference on random slot mixes
(interpreter on CPU, compiled on CUDA).

Bound for the Triton kernels, max |out - ref| / max |ref|: bfloat16 2e-2, float16 5e-3 (they sum in
float32 tiles; the reference multiplies with torch's matmul, then rounds as PEFT does).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.kernels.lora import add_lora_ref

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def stacks(slots: int, rank: int, width_in: int, width_out: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank, width_in, generator=g) * width_in ** -0.5
    b = torch.randn(slots, width_out, rank, generator=g) * rank ** -0.5
    scaling = torch.rand(slots, generator=g) + 0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), scaling.to(DEVICE)


def test_reference_adds_each_tokens_own_adapter_in_peft_order():
    """Every token's row gets its slot's lora_B(lora_A(x)) * scaling, as PEFT computes it for one
    adapter; a token without one (-1) keeps the base output."""
    a, b, scaling = stacks(3, 8, 32, 48, torch.bfloat16)
    a, b, scaling = a.cpu(), b.cpu(), scaling.cpu()
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    base = torch.randn(7, 48, dtype=torch.bfloat16)
    token_slots = torch.tensor([2, 2, -1, 0, 1, 1, -1], dtype=torch.int32)
    out = add_lora_ref(base.clone(), x, a, b, scaling, token_slots)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            assert torch.equal(out[t], base[t])
            continue
        lora_a = torch.nn.functional.linear(x[t : t + 1], a[slot])
        expected = base[t] + (torch.nn.functional.linear(lora_a, b[slot]) * float(scaling[slot]))[0]
        assert torch.equal(out[t], expected)


triton_lora = pytest.importorskip("pagedserve.kernels.triton.lora") if CUDA or os.environ.get(
    "TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(triton_lora is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,slots,rank,width_in,width_out", [
    (1, 4, 16, 64, 96),  # one decode
    (9, 4, 48, 96, 80),  # a stacked qkv's rank (3 x 16); widths not multiples of the tiles
    (70, 3, 8, 64, 64),  # a prefill chunk, rank under one tile
])
def test_triton_kernels_match_the_reference(dtype, tokens, slots, rank, width_in, width_out):
    a, b, scaling = stacks(slots, rank, width_in, width_out, dtype, seed=tokens)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, width_in, generator=g).to(DEVICE, dtype)
    base = torch.randn(tokens, width_out, generator=g).to(DEVICE, dtype)
    token_slots = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32).to(DEVICE)
    ref = add_lora_ref(base.clone(), x, a, b, scaling, token_slots)
    out = triton_lora.add_lora_triton(base.clone(), x, a, b, scaling, token_slots)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < TOL[dtype]
    untouched = token_slots < 0
    assert torch.equal(out[untouched], base[untouched])  # no adapter: the base output, bit for bit
