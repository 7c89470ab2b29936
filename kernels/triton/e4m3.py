"""float8_e4m3fn in software, shared by the Triton kernels that read or write e4m3 bytes.

Triton's own fp8 type for e4m3fn (tl.float8e4nv) only exists on compute capability
>= 8.9: on an A100 (sm_80) any kernel that names it fails to compile ("type fp8e4nv
not supported in this architecture"). These helpers work on the raw bytes with
integer arithmetic instead, so they compile for every target and behave the same
under TRITON_INTERPRET=1:

  * `e4m3_bits`: float32 -> e4m3fn bit pattern (uint8), saturating, round half to even;
    bit-identical to torch's `.to(torch.float8_e4m3fn)` (the cache write and the
    per-token activation quantizer store through uint8 views with it);
  * `decode_e4m3`: e4m3fn bit pattern -> exact float32 (the W8A16 GEMM, and paged
    attention over an fp8 KV cache on GPUs without hardware e4m3);
  * `e4m3_to_float`: the bytes as exact floats, by the hardware where NATIVE, else `decode_e4m3`
    (paged attention's fp8 KV, the fused MoE kernel's fp8 experts).

`native_fp8(device)` is the host-side test the launchers use to pick between the
hardware conversion and `decode_e4m3` (a constexpr of the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NATIVE_FP8_CAPABILITY = (8, 9)  # first compute capability with e4m3 (tl.float8e4nv) in hardware


def native_fp8(device: torch.device) -> bool:
    """Whether kernels on `device` may use tl.float8e4nv (hardware e4m3 conversion and FP8
    tensor cores): CUDA compute capability >= 8.9. Off CUDA (TRITON_INTERPRET=1) True:
    the interpreter converts fp8e4nv exactly, as an H100 does."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= NATIVE_FP8_CAPABILITY
    return True


@triton.jit
def e4m3_bits(x):
    """float32 -> float8_e4m3fn bit pattern (uint8), saturating, round-half-even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): keep 3 of 23 mantissa bits, rounding half to even
    # (a carry ripples into the exponent), then rebias the exponent 127 -> 7.
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: value = m * 2^-9, m = round_half_even(|x| * 512) in 0..8
    # (m = 8 is the smallest normal, whose code is also 8). Adding 2^23 makes the
    # float unit in the last place 1, so the hardware rounding does the work.
    shifted = tl.abs(x) * 512.0 + 8388608.0
    sub = shifted.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 0x3C800000, normal, sub) | sign
    return code.to(tl.uint8)


@triton.jit
def decode_e4m3(b):
    """uint8 e4m3fn bit patterns -> exact fp32 values (NaN codes are not expected)."""
    u = b.to(tl.int32)
    e = (u >> 3) & 0xF
    m = u & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    r = tl.where(e == 0, sub, normal)
    return tl.where(u >= 128, -r, r)


@triton.jit
def e4m3_to_float(x, NATIVE: tl.constexpr):
    """uint8 e4m3fn bytes -> a float tensor holding the exact values: tl.float8e4nv
    (hardware conversion, sm_89+) when NATIVE, else float32 decoded with integer ops."""
    if NATIVE:
        y = x.to(tl.float8e4nv, bitcast=True)
    else:
        y = decode_e4m3(x)
    return y


__all__ = ["NATIVE_FP8_CAPABILITY", "decode_e4m3", "e4m3_bits", "e4m3_to_float", "native_fp8"]
