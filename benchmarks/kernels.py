"""Kernel micro-benchmarks at Llama-3-8B shapes, reported against measured device ceilings.

Rows: dense bf16 matmul (torch, the baseline), W4A16 (Triton), FP8 weights (Triton; FP8
tensor cores on sm89+, W8A16 before), torch._scaled_mm (FP8 GEMM only, pre-quantized
activations, for reference), and paged decode attention if
`pagedserve.kernels.triton.paged_attention` exists (baseline: SDPA over the cache
gathered through the block table, and SDPA alone on a pre-gathered cache).

Ceilings are measured, not taken from a spec sheet: bandwidth = a 1 GiB device-to-device
copy (read + write bytes), bf16 = an 8192^3 torch matmul, fp8 = an 8192^3
torch._scaled_mm. GB/s counts the minimal traffic (weights + activations in + output);
for decode-sized M that is the weight-bytes roofline. Times are medians of
triton.testing.do_bench (L2 flushed between runs).

    python benchmarks/kernels.py [--m 1,4,16,64,2048,4096] [--shapes qo,kv,gate_up,down]
                                 [--no-attention] [--rep 100]
    python benchmarks/kernels.py --smoke    # tiny shapes on CPU via TRITON_INTERPRET=1;
                                            # checks the plumbing, timings meaningless
    python benchmarks/kernels.py --static [--targets sm_80,sm_89,sm_90] [--dtypes bfloat16]
                                          [--reduced]   # no GPU needed, see below

--static: every kernel configuration the launchers choose (kernels/triton/aot.py: Llama-3-8B and
SmolLM2-135M shapes, bf16/fp16/fp32 activations, bf16/fp16/fp8 KV) compiled ahead of time
for each target on the CPU; per configuration and target: registers per thread, spilled
words, shared memory, and the occupancy bound (resident warps per SM and what limits
them: registers, shared memory, warp or block slots; aot.occupancy). Then, for the first
scenario that chose the configuration, the bytes the kernel must move against the bytes
its tiling is designed to move (global-memory loads and stores it issues; masked lanes
move nothing; L2 hits are not subtracted, so "designed" is an upper bound on DRAM traffic):

  paged attention  must: K and V of every sequence's keys (seq_len x kv_heads x head_dim x
                   2 x KV bytes) + query + output. designed: each q-block (BLOCK_Q tokens)
                   reads the K/V of the keys it can see (context + its last token), so a
                   prefill of q tokens reads the context ~q / BLOCK_Q times; query and
                   output once; under split-KV (NUM_SPLITS > 1) + fp32 partials
                   (acc, max, sum) written.
  split reduce     must: the output. designed: the partials read + the output.
  cache write      must = designed: new K and V read, written to the cache.
  W4A16 GEMM       must: packed weight (K x N / 2) + scales and offsets ((K / G) x N each)
                   + x (M x K) + output (M x N). designed: the weight and its scales /
                   offsets once per row of output tiles (cdiv(M, BLOCK_M) times; scales and
                   offsets once per K tile, K / BLOCK_K, not per group), x once per column
                   of tiles (cdiv(N, BLOCK_N)), the output once, or under split-K an fp32
                   partial per K slice (SPLIT x M x N x 4).
  FP8 GEMM         as W4A16 with a 1-byte weight and fp32 per-channel scale, activations
                   in the kernel's input dtype (e4m3 after per-token quant, or bf16/fp16).
  per-token quant  must: x read once, e4m3 + scale written. designed: x read twice (amax,
                   then quantize).
  split-K reduce   must: the output. designed: SPLIT fp32 partials read + the output.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE = 4096, 14336
N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
# (name, N = out_features, K = in_features) of Llama-3-8B's linear layers.
SHAPES = {
    "qo": ("q_proj / o_proj", HIDDEN, HIDDEN),
    "kv": ("k_proj / v_proj", N_KV_HEADS * HEAD_DIM, HIDDEN),
    "gate_up": ("gate_proj / up_proj", INTERMEDIATE, HIDDEN),
    "down": ("down_proj", HIDDEN, INTERMEDIATE),
}
SMOKE_SHAPES = {"qo": ("q_proj / o_proj (smoke)", 256, 256), "down": ("down_proj (smoke)", 256, 512)}


@dataclass
class Row:
    kernel: str
    shape: str
    m: int
    n: int
    k: int
    seconds: float
    nbytes: float
    flops: float
    peak: str  # which compute ceiling applies: "bf16" or "fp8"
    baseline: Optional[float] = None  # seconds of the bf16 baseline for the same problem


@dataclass
class Ceilings:
    bandwidth: float  # bytes / s
    bf16: float  # flop / s
    fp8: Optional[float]


def make_timer(device: torch.device, rep_ms: int) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        def timer(fn):
            fn()  # first call: compile + config timing, kept out of the measurement
            torch.cuda.synchronize()
            return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") / 1e3
    else:
        def timer(fn):
            fn()
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
    return timer


def measure_ceilings(device: torch.device, timer, smoke: bool) -> Ceilings:
    n = 1 << (20 if smoke else 29)  # bf16 elements: 1 GiB on a GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 2 / timer(lambda: dst.copy_(src))
    del src, dst
    s = 256 if smoke else 8192
    a = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    b = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    bf16 = 2 * s**3 / timer(lambda: a @ b)
    fp8 = None
    if device.type == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9):
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            fp8 = 2 * s**3 / timer(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16))
        except Exception as e:  # noqa: BLE001 - report and go on without the fp8 ceiling
            print(f"fp8 ceiling not measured: torch._scaled_mm failed ({e})")
    return Ceilings(bandwidth, bf16, fp8)


def bench_linear(shapes, ms: List[int], device, timer) -> List[Row]:
    from pagedserve.kernels.fp8 import quantize_fp8, quantize_per_token_fp8
    from pagedserve.kernels.triton.fp8 import default_mode, fp8_matmul_triton
    from pagedserve.kernels.int4 import quantize_int4
    from pagedserve.kernels.triton.int4 import w4a16_matmul_triton

    mode = default_mode(device)
    scaled_mm = (device.type == "cuda" and hasattr(torch, "_scaled_mm")
                 and torch.cuda.get_device_capability(device) >= (8, 9))
    rows: List[Row] = []
    for key, (label, n, k) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        w4 = quantize_int4(w)
        w8 = quantize_fp8(w)
        w8_t = w8.weight.t()  # column-major [K, N] operand for _scaled_mm
        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            io = 2 * (m * k + m * n)
            flops = 2.0 * m * n * k
            base = timer(lambda: F.linear(x, w))
            rows.append(Row("bf16 matmul (torch)", label, m, n, k, base, 2 * n * k + io, flops, "bf16", base))
            t = timer(lambda: w4a16_matmul_triton(x, w4))
            rows.append(Row("w4a16 (triton)", label, m, n, k, t, w4.nbytes + io, flops, "bf16", base))
            t = timer(lambda: fp8_matmul_triton(x, w8))
            rows.append(Row(f"fp8 weights, {mode} (triton)", label, m, n, k, t, w8.nbytes + io, flops,
                            "fp8" if mode == "fp8" else "bf16", base))
            if scaled_mm and m % 16 == 0:
                xq, _ = quantize_per_token_fp8(x)
                one = torch.ones((), device=device)
                try:
                    t = timer(lambda: torch._scaled_mm(xq, w8_t, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                    rows.append(Row("fp8 _scaled_mm (gemm only)", label, m, n, k, t, n * k + m * k + 2 * m * n,
                                    flops, "fp8", base))
                except Exception as e:  # noqa: BLE001
                    print(f"_scaled_mm skipped for {label} M={m}: {e}")
            del x
        del w, w4, w8, w8_t
    return rows


def bench_attention(device, timer, smoke: bool) -> List[Row]:
    try:
        from pagedserve.kernels.triton.paged_attention import paged_attention_triton
    except ImportError as e:
        print(f"paged attention: skipped ({e})")
        return []
    batch, context, block_size = (4, 256, 16) if smoke else (64, 4096, 16)
    heads, kv_heads, head_dim = (8, 2, 64) if smoke else (N_HEADS, N_KV_HEADS, HEAD_DIM)
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, generator=gen).to(dt)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, generator=gen).to(dt)
    block_tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, head_dim, device=device, generator=gen).to(dt)
    scale = 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads

    def gather(cache):  # [B, kvh, L, d] through the block table
        return cache[block_tables.long()].view(batch, context, kv_heads, head_dim).transpose(1, 2)

    def sdpa(k, v):  # GQA folded into the query axis: [B, kvh, group, d]
        q = query.view(batch, kv_heads, group, head_dim)
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    kg, vg = gather(key_cache).contiguous(), gather(value_cache).contiguous()
    label = f"decode B={batch} ctx={context} {heads}q/{kv_heads}kv d={head_dim}"
    nbytes = 2 * key_cache.numel() * key_cache.element_size() + 2 * query.numel() * query.element_size()
    flops = 4.0 * batch * heads * context * head_dim
    base = timer(lambda: sdpa(gather(key_cache), gather(value_cache)))
    rows = [Row("attention: gather + sdpa (torch)", label, batch, heads, context, base, nbytes, flops, "bf16", base)]
    t = timer(lambda: sdpa(kg, vg))
    rows.append(Row("attention: sdpa, pre-gathered (torch)", label, batch, heads, context, t, nbytes, flops, "bf16", base))
    try:
        t = timer(lambda: paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens,
                                                 query_start_loc, scale))
        rows.append(Row("paged attention (triton)", label, batch, heads, context, t, nbytes, flops, "bf16", base))
    except TypeError as e:  # the kernel's signature changed under us
        print(f"paged attention: call failed ({e})")
    return rows


def render(rows: List[Row], ceil: Ceilings) -> str:
    out = ["| kernel | shape | M | N | K | time (us) | GB/s | % BW | TFLOP/s | % peak | speedup vs bf16 |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gbs = r.nbytes / r.seconds
        fl = r.flops / r.seconds
        peak = ceil.fp8 if r.peak == "fp8" and ceil.fp8 else ceil.bf16
        speed = f"{r.baseline / r.seconds:.2f}x" if r.baseline else "-"
        out.append(f"| {r.kernel} | {r.shape} | {r.m} | {r.n} | {r.k} | {r.seconds * 1e6:.1f} | {gbs / 1e9:.0f} | "
                   f"{100 * gbs / ceil.bandwidth:.0f}% | {fl / 1e12:.1f} | {100 * fl / peak:.0f}% ({r.peak}) | {speed} |")
    return "\n".join(out)


def targets(rows: List[Row], ceil: Ceilings) -> List[str]:
    """The goals this project reports against (not asserted)."""
    lines = []

    def verdict(ok):
        return "met" if ok else "MISSED"

    for r in rows:
        bw = r.nbytes / r.seconds / ceil.bandwidth
        speed = r.baseline / r.seconds if r.baseline else 0.0
        if r.kernel == "paged attention (triton)":
            lines.append(f"- paged decode attention {100 * bw:.0f}% of measured bandwidth (target >= 80%): {verdict(bw >= 0.8)}")
        elif r.kernel.startswith("w4a16") and r.m <= 16:
            lines.append(f"- W4A16 {r.shape} M={r.m}: {100 * bw:.0f}% of weight-bytes roofline (target >= 70%): "
                         f"{verdict(bw >= 0.7)}" + (f"; {speed:.2f}x bf16 (target >= 2.5x): {verdict(speed >= 2.5)}"
                                                    if r.m == 1 else ""))
        elif r.kernel.startswith("fp8 weights") and r.m >= 2048:
            lines.append(f"- FP8 {r.shape} M={r.m}: {speed:.2f}x bf16 (target >= 1.5x): {verdict(speed >= 1.5)}")
    return lines


# ------------------------------------------------------------------ --static


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _attention_traffic(b) -> tuple:
    q, out, kc = b["q_ptr"], b["out_ptr"], b["k_ptr"]
    kv_heads, head_dim = kc.shape[2], kc.shape[3]
    per_key = 2 * kv_heads * head_dim * kc.element_size()  # K and V of one key, all kv heads
    lens = b["seq_lens_ptr"].tolist()
    starts = b["query_start_loc_ptr"].tolist()
    block_q = b["BLOCK_Q"]
    io = _nbytes(q) + _nbytes(out)
    must = sum(lens) * per_key + io
    designed = io
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        context = seq_len - q_len
        for qb in range(-(-q_len // block_q)):
            designed += (context + min((qb + 1) * block_q, q_len)) * per_key
    if b["NUM_SPLITS"] > 1:
        designed += q.shape[0] * q.shape[1] * b["NUM_SPLITS"] * (b["HEAD_DIM_PAD"] + 2) * 4
    return must, designed


def _gemm_traffic(b, grid, x, w_bytes, scale_bytes_designed, out) -> tuple:
    m, n, k = b["M"], b["N"], b["K"]
    row_tiles, col_tiles = -(-m // b["BLOCK_M"]), -(-n // b["BLOCK_N"])
    split = grid[1] if len(grid) > 1 else 1
    out_bytes = m * n * out.element_size() if split == 1 else split * m * n * 4
    x_bytes = m * k * x.element_size()
    designed = row_tiles * (w_bytes + scale_bytes_designed) + col_tiles * x_bytes + out_bytes
    return x_bytes, out_bytes, designed


def traffic(launch) -> tuple:
    """(bytes the kernel must move, bytes its tiling is designed to move) for a recorded
    launch (see the module docstring for the formulas)."""
    b = launch.bound()
    name = launch.kernel
    if name == "_paged_attention_kernel":
        return _attention_traffic(b)
    if name == "_split_reduce_kernel":
        out = b["out_ptr"]
        return _nbytes(out), _nbytes(b["part_acc_ptr"]) + 2 * _nbytes(b["part_m_ptr"]) + _nbytes(out)
    if name == "_write_kv_kernel":
        t = b["key_ptr"].shape[0]
        row = b["num_kv_heads"] * b["HEAD_DIM"]
        nbytes = 2 * t * row * (b["key_ptr"].element_size() + b["key_cache_ptr"].element_size())
        return nbytes, nbytes
    if name == "_splitk_reduce_kernel":
        out = b["out_ptr"]
        return _nbytes(out), _nbytes(b["part_ptr"]) + _nbytes(out)
    if name == "_per_token_quant_kernel":
        x, q = b["x_ptr"], b["q_ptr"]
        extra = _nbytes(q) + 4 * x.shape[0]
        return _nbytes(x) + extra, 2 * _nbytes(x) + extra
    if name == "_w4a16_kernel":
        m, n, k, g = b["M"], b["N"], b["K"], b["group_size"]
        s_el = b["s_ptr"].element_size()
        w_bytes = k * n // 2
        must_scales = 2 * (k // g) * n * s_el
        designed_scales = 2 * (k // b["BLOCK_K"]) * n * s_el
        x_bytes, out_bytes, designed = _gemm_traffic(b, launch.grid, b["x_ptr"], w_bytes, designed_scales,
                                                     b["out_ptr"])
        return w_bytes + must_scales + x_bytes + m * n * b["out_ptr"].element_size(), designed
    if name == "_fp8_gemm_kernel":
        m, n, k = b["M"], b["N"], b["K"]
        w_bytes = n * k + 4 * n
        x_bytes, out_bytes, designed = _gemm_traffic(b, launch.grid, b["a_ptr"], w_bytes, 0, b["out_ptr"])
        return w_bytes + x_bytes + m * n * b["out_ptr"].element_size(), designed
    return 0, 0


def static_report(targets: List[str], dtypes: List[torch.dtype], reduced: bool) -> str:
    from pagedserve.kernels.triton import aot

    t0 = time.perf_counter()
    results = aot.compile_all(targets, dtypes, reduced=reduced)
    seconds = time.perf_counter() - t0
    rows: dict = {}  # config key -> [config, {target: result}]
    for cfg, r in results:
        rows.setdefault(cfg.key, [cfg, {}])[1][r.target] = r

    def cell(r) -> str:
        return "-" if r is None else r.cell

    lines = [f"{len(results)} compiles ({len(rows)} configurations) for {', '.join(targets)} in {seconds:.0f} s "
             f"(triton {__import__('triton').__version__}, ptxas of the wheel)",
             "cell: registers/thread, spilled words, shared memory KiB, resident warps/SM bound (limiter); "
             "'-': not chosen on that target. Bytes: for the first scenario listed (see --help).", ""]
    for kernel in dict.fromkeys(cfg.kernel for cfg, _ in rows.values()):
        lines += [f"### {kernel}", "",
                  "| config | " + " | ".join(targets) + " | scenario | must MB | designed MB | x |",
                  "|---|" + "---|" * len(targets) + "---|---:|---:|---:|"]
        for cfg, by_target in rows.values():
            if cfg.kernel != kernel:
                continue
            must, designed = traffic(cfg.launch)
            ratio = f"{designed / must:.2f}" if must else "-"
            timed = " (timed candidate only)" if cfg.timed_only else ""
            lines.append(f"| {cfg.summary}{timed} | " + " | ".join(cell(by_target.get(t)) for t in targets)
                         + f" | {cfg.uses[0]} (+{len(cfg.uses) - 1}) | {must / 1e6:.2f} | {designed / 1e6:.2f} "
                         f"| {ratio} |")
        lines.append("")
    bad = [r for _, r in results if not r.ok or r.spills or not r.smem_ok]
    lines.append(f"{len(bad)} of {len(results)} compiles failed, spilled or exceed shared memory")
    lines += ["", "Programs one decode token's quantized GEMMs launch (Llama-3-8B, M = 1):", ""]
    lines += aot.programs_table([row for t in targets for row in aot.decode_programs(aot.TARGETS[t])])
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1,4,16,64,2048,4096", help="comma-separated token counts (GEMM M)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time per measurement, ms")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    p.add_argument("--static", action="store_true",
                   help="compile every kernel configuration for sm_80/sm_89/sm_90 on the CPU and print its "
                        "registers, spills, shared memory, occupancy bound and bytes moved (no GPU needed)")
    p.add_argument("--targets", default="sm_80,sm_89,sm_90", help="--static: targets")
    p.add_argument("--dtypes", default="bfloat16,float16,float32", help="--static: activation dtypes")
    p.add_argument("--reduced", action="store_true", help="--static: aot.representative configurations only")
    args = p.parse_args()
    if args.static:
        print(static_report(args.targets.split(","), [getattr(torch, d) for d in args.dtypes.split(",")],
                            args.reduced))
        return

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel module is imported
        device = torch.device("cpu")
        shapes = SMOKE_SHAPES
        ms = [1, 4, 16, 64]
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/kernels.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is "
                     "False). Kernel correctness on CPU: `pytest tests/kernels` (Triton interpreter); "
                     "plumbing check: `python benchmarks/kernels.py --smoke`.")
        device = torch.device("cuda")
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
        ms = [int(v) for v in args.m.split(",")]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter, smoke run)"
    print(f"device: {name}")
    print(f"torch {torch.__version__}", end="")
    try:
        import triton

        print(f", triton {triton.__version__}")
    except ImportError:
        sys.exit("\ntriton is not installed")
    timer = make_timer(device, args.rep)
    ceil = measure_ceilings(device, timer, args.smoke)
    fp8_txt = f"{ceil.fp8 / 1e12:.0f} TFLOP/s" if ceil.fp8 else "n/a"
    print(f"measured ceilings: bandwidth {ceil.bandwidth / 1e9:.0f} GB/s (1 GiB D2D copy), "
          f"bf16 matmul {ceil.bf16 / 1e12:.0f} TFLOP/s, fp8 _scaled_mm {fp8_txt}\n")

    rows = bench_linear(shapes, ms, device, timer)
    if not args.no_attention:
        rows += bench_attention(device, timer, args.smoke)
    print(render(rows, ceil))
    print("\ntargets (reported, not asserted)" + (" -- smoke run, numbers meaningless:" if args.smoke else ":"))
    print("\n".join(targets(rows, ceil)) or "- none applicable to the selected sizes")


if __name__ == "__main__":
    main()
