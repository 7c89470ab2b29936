"""The C rotary embedding (kernels/cpu/rotary.py) against the model's torch rotation.

Same rounding order as transformers (each product rounded to the dtype, then their sum), so
both dtypes must match bit for bit, read from a view of the fused q/k/v projection as the
model passes it."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.models.llama import _rotate_half
from pagedserve.kernels.cpu import rotary as rotary_cpu

built = pytest.mark.skipif(rotary_cpu.LIBRARY.get() is None, reason="the C rotary is not built here (no C compiler)")


def tables(tokens: int, head_dim: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 100
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@built
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 32, 600])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_matches_torch_bit_for_bit(dtype, tokens, head_dim):
    g = torch.Generator().manual_seed(tokens * 1000 + head_dim)
    heads, kv_heads = 9, 3
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # rows of a wider tensor
    cos, sin = tables(tokens, head_dim, dtype, g)
    before = qkv.clone()
    out = rotary_cpu.rotary(qk, cos, sin)
    assert out.is_contiguous() and torch.equal(qkv, before)  # the projection is left as it was
    assert torch.equal(out, qk * cos + _rotate_half(qk) * sin)


def test_what_it_does_not_take_is_left_to_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 64, generator=g)
    cos, sin = tables(4, 64, torch.float32, g)
    assert rotary_cpu.rotary(x.half(), cos.half(), sin.half()) is None  # float16
    assert rotary_cpu.rotary(x, cos.bfloat16(), sin.bfloat16()) is None  # tables of another dtype
    assert rotary_cpu.rotary(x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin) is None  # heads not rows
    assert rotary_cpu.rotary(x, cos[:2], sin[:2]) is None  # a table row short
