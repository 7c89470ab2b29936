"""Paged decode attention at Llama-3-8B shapes: the Triton kernel vs torch SDPA.

Decode attention is memory bound (every step reads the whole KV context once), so
the figure of merit is achieved bandwidth: KV bytes read / kernel time, shown
against a measured device-to-device copy ceiling (read + write bytes / time).

Rows:
  triton paged          the unified kernel through the block tables (split-KV by heuristic)
  triton paged, no split     the same with num_splits=1
  torch SDPA (dense)    SDPA over K/V already gathered into contiguous [b, kv_heads, L, d]:
                        the best case for a non-paged kernel, gather not timed
  torch gather + SDPA   the reference path (paged_attention_ref): gather, then SDPA
                        (GB/s counts the cache bytes once, i.e. effective bandwidth)

    python benchmarks/attention_bench.py [--batch 64] [--context 4096] [--kv-dtype fp8]

Needs a CUDA device; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto", help="auto: same as --dtype")
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args()


def time_ms(fn, iters: int) -> float:
    """Median over `iters` CUDA-event-timed calls after warm-up (first call compiles)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_ceiling_gbs(iters: int) -> float:
    """Device-to-device copy of 1 GiB: (read + write) bytes / time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_bench: no CUDA device; this benchmark measures GPU memory bandwidth and has nothing to run on CPU")
    from pagedserve.kernels.triton.cache_write import write_kv_cache_triton
    from pagedserve.kernels.paged_attention import paged_attention_ref
    from pagedserve.kernels.triton.paged_attention import paged_attention_triton

    dtype = getattr(torch, args.dtype)
    fp8 = args.kv_dtype == "fp8"
    b, L, h, kvh, d, bs = args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size
    blocks_per_seq = -(-L // bs)
    num_blocks = b * blocks_per_seq
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    # Cache filled through the write kernel (quantizing when fp8), blocks shuffled.
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    # zeros, not empty: the reference reads (masked) tail slots of the last blocks
    key_cache = torch.zeros(num_blocks, bs, kvh, d, dtype=dtype, device=dev).to(cache_dtype)
    value_cache = key_cache.clone()
    block_tables = torch.randperm(num_blocks, device=dev, generator=g).view(b, blocks_per_seq).to(torch.int32)
    pos = torch.arange(L, device=dev)
    slots = (block_tables[:, pos // bs].long() * bs + pos % bs).flatten()
    k_scale = v_scale = 4.0 / 448 if fp8 else None
    for chunk in slots.split(1 << 16):
        keys = torch.randn(chunk.numel(), kvh, d, device=dev, dtype=dtype, generator=g)
        values = torch.randn(chunk.numel(), kvh, d, device=dev, dtype=dtype, generator=g)
        write_kv_cache_triton(keys, values, key_cache, value_cache, chunk, k_scale=k_scale, v_scale=v_scale)
    query = torch.randn(b, h, d, device=dev, dtype=dtype, generator=g)
    seq_lens = torch.full((b,), L, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(d)
    common = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}

    # Correctness at the benchmark shape.
    out = paged_attention_triton(*common, **scales, max_seq_len=L)
    ref = paged_attention_ref(*common, **scales)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    # Dense, pre-gathered K/V for SDPA (dequantized once when fp8: SDPA has no fp8 input).
    def dense(cache: torch.Tensor, s: float | None) -> torch.Tensor:
        rows = cache.view(num_blocks, -1)[block_tables.long().flatten()]
        x = rows.view(b, blocks_per_seq * bs, kvh, d)[:, :L].transpose(1, 2).contiguous()
        return (x.float() * s).to(dtype) if fp8 else x

    k_dense, v_dense = dense(key_cache, k_scale), dense(value_cache, v_scale)
    q4 = query.view(b, h, 1, d)

    kv_bytes = 2 * b * L * kvh * d * key_cache.element_size()
    dense_bytes = 2 * b * L * kvh * d * k_dense.element_size()
    rows = [
        ("triton paged", kv_bytes, lambda: paged_attention_triton(*common, **scales, max_seq_len=L)),
        ("triton paged, no split", kv_bytes, lambda: paged_attention_triton(*common, **scales, num_splits=1)),
        ("torch SDPA (dense)", dense_bytes,
         lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)),
        ("torch gather + SDPA", kv_bytes, lambda: paged_attention_ref(*common, **scales)),
    ]
    ceiling = copy_ceiling_gbs(args.iters)
    name = torch.cuda.get_device_name(dev)
    print(f"{name}: batch {b} x context {L}, {h} heads / {kvh} KV heads, head_dim {d}, block {bs}, "
          f"{args.dtype} query, {'fp8 e4m3' if fp8 else args.dtype} KV; KV read {kv_bytes / 1e9:.3f} GB per step")
    print(f"max |triton - ref| / max |ref| = {err:.2e}")
    print(f"device copy ceiling: {ceiling:,.0f} GB/s")
    print(f"{'':26s} {'ms':>8s} {'GB/s':>8s} {'% ceiling':>10s}")
    for label, nbytes, fn in rows:
        ms = time_ms(fn, args.iters)
        gbs = nbytes / (ms * 1e-3) / 1e9
        print(f"{label:26s} {ms:8.3f} {gbs:8,.0f} {100 * gbs / ceiling:9.1f}%")


if __name__ == "__main__":
    main()
