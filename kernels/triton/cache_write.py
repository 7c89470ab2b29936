"""Triton cache write: scatter new K/V rows into their paged-cache slots.

Same signature as `write_kv_cache_ref` (kernels/cache_write.py). One program per
token writes all its kv heads (a [heads, head_dim] tile) for K and V; a negative
slot means "skip". Slot arithmetic is int64 (slot = block * block_size + offset).

FP8 (float8_e4m3fn cache): x / scale is computed with a correctly rounded
division (tl.math.fdiv(..., ieee_rounding=True)), saturated to +-448 and encoded
to e4m3 bits with integer arithmetic (`triton/e4m3.py`'s `e4m3_bits`: round to
nearest-even, subnormals included), then stored through a uint8 view of the
cache. Doing the encoding by hand makes the result bit-identical to torch's
`.to(torch.float8_e4m3fn)` both compiled and under TRITON_INTERPRET=1 (the
interpreter's own float -> fp8 cast truncates and can carry a rounded mantissa
into the wrong exponent bit), and keeps fp8 types out of the kernel, so it
compiles for every GPU (sm_80 has no tl.float8e4nv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged_attention import is_fp8, kv_scales
from .e4m3 import e4m3_bits


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_kv_heads,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    t = token.to(tl.int64)
    h64 = h.to(tl.int64)

    k = tl.load(key_ptr + t * stride_kt + (h64 * stride_kh)[:, None] + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + (h64 * stride_vh)[:, None] + d[None, :], mask=mask)
    if FP8:
        k = e4m3_bits(tl.math.fdiv(k.to(tl.float32), k_scale, ieee_rounding=True))
        v = e4m3_bits(tl.math.fdiv(v.to(tl.float32), v_scale, ieee_rounding=True))
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + (h64 * stride_kch)[:, None] + d[None, :]
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + (h64 * stride_vch)[:, None] + d[None, :]
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """key/value [num_tokens, kv_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} does not match cache {tuple(key_cache.shape)}")
    fp8 = is_fp8(key_cache)
    if is_fp8(value_cache) != fp8:
        raise ValueError("key and value caches must both be fp8 or neither")
    ks, vs = kv_scales(key_cache, k_scale, v_scale)
    if fp8:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim axis must be contiguous")
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads,
        ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8,
        num_warps=4,
    )


__all__ = ["write_kv_cache_triton"]
