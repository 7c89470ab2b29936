"""CPU paged attention: the torch reference (kernels/paged_attention.py) vs the CPU attention
(kernels/cpu/paged_attention.py) at SmolLM2-135M shapes (9 heads, 3 KV heads, head_dim 64,
block 16), and the whole engine with each.

Kernel table: one "step" of a case is LAYERS calls (one per layer, each on its own cache)
with fresh metadata tensors, so the CPU attention builds its step plan once per step as
in the engine; ms per call = step time / LAYERS. The two alternate step by step for
--rounds rounds (the order flips every round); median and minimum shown (on a shared
machine the minimum is the steadier of the two); ratio = reference / CPU attention.
Block tables are shuffled (no sequence's blocks are adjacent).

Engine table (--engine): benchmarks/offline_throughput.py's seeded workload (its first
--requests requests), in-flight batching, attention_backend torch and cpu alternating for
--rounds runs each in one process; output tokens/s per run, ratio of the medians, and the
seconds spent inside attention per kind of step (decode-only, mixed, prefill-only; the
implementations are wrapped where kernels/dispatch.py hands them out).

    python benchmarks/cpu_attention.py [--dtype bfloat16] [--rounds 7]
    python benchmarks/cpu_attention.py --engine [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import run_pagedserve  # noqa: E402
from workload import machine, offline_workload  # noqa: E402

from pagedserve.backend import LLMEngine  # noqa: E402
from pagedserve.backend.process_tuning import keep_freed_memory_in_heap  # noqa: E402
from pagedserve.kernels import dispatch  # noqa: E402
from pagedserve.kernels.numerics import cdiv  # noqa: E402
from pagedserve.kernels.paged_attention import paged_attention_ref  # noqa: E402
from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
IMPLEMENTATIONS = {"reference": paged_attention_ref, "cpu": paged_attention_cpu}


def cases() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(query_len, seq_len) per sequence]): decodes at batch 1/8/32 x context
    128/512/1024, an engine-like ragged decode batch, prefill chunks of 256/512."""
    out = [(f"decode b={b} ctx={ctx}", [(1, ctx)] * b) for b in (1, 8, 32) for ctx in (128, 512, 1024)]
    ragged = [(1, 30 + (i * 173) % 521) for i in range(32)]  # contexts spread over 30..550
    out.append(("decode b=32 ctx=30..550 (ragged)", ragged))
    out += [(f"prefill {q} tokens", [(q, q)]) for q in (256, 512)]
    out.append(("chunk of 256 after 512 cached", [(256, 768)]))
    return out


class PagedInputs:
    """Random query, LAYERS caches and shuffled block tables for one case."""

    def __init__(self, pairs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        q_lens, seq_lens = zip(*pairs)
        blocks = [cdiv(s, BLOCK_SIZE) for s in seq_lens]
        num_blocks = sum(blocks)
        ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_tables = torch.zeros(len(pairs), max(blocks), dtype=torch.int32)
        for i, n in enumerate(blocks):
            self.block_tables[i, :n] = ids[sum(blocks[:i]) : sum(blocks[: i + 1])]
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                       for _ in range(LAYERS)]
        self.query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)

    def step(self, attend) -> float:
        """Seconds for one step: every layer once, on metadata tensors new to this step."""
        meta = (self.block_tables.clone(), self.seq_lens.clone(), self.query_start_loc.clone())
        start = time.perf_counter()
        for key_cache, value_cache in self.caches:
            attend(self.query, key_cache, value_cache, *meta, HEAD_DIM**-0.5)
        return time.perf_counter() - start


def kernel_table(dtype: torch.dtype, rounds: int) -> list[str]:
    lines = ["| case | query tokens | reference ms/call, median (min) | CPU attention ms/call, median (min) | "
             "ratio of medians | ratio of minima |", "|---|---:|---:|---:|---:|---:|"]
    all_cases = cases()
    for index, (name, pairs) in enumerate(all_cases, 1):
        inputs = PagedInputs(pairs, dtype, seed=index)
        times = {impl: [] for impl in IMPLEMENTATIONS}
        order = list(IMPLEMENTATIONS)
        for impl in order:
            inputs.step(IMPLEMENTATIONS[impl])  # warm-up
        for _ in range(rounds):
            for impl in order:
                times[impl].append(inputs.step(IMPLEMENTATIONS[impl]) / LAYERS * 1e3)
            order.reverse()
        ref, new = statistics.median(times["reference"]), statistics.median(times["cpu"])
        ref_min, new_min = min(times["reference"]), min(times["cpu"])
        print(f"[{index}/{len(all_cases)}] {name}: reference {ref:.3f} ms, cpu {new:.3f} ms ({ref / new:.2f}x; "
              f"minima {ref_min / new_min:.2f}x)", file=sys.stderr, flush=True)
        lines.append(f"| {name} | {inputs.query.shape[0]} | {ref:.3f} ({ref_min:.3f}) | {new:.3f} ({new_min:.3f}) | "
                     f"{ref / new:.2f}x | {ref_min / new_min:.2f}x |")
    return lines


STEP_KINDS = ("decode-only", "mixed", "prefill-only")


class AttentionClock:
    """Seconds inside attention per kind of step, for the implementations dispatch hands out."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, attend):
        def timed(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs):
            start = time.perf_counter()
            out = attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs)
            decodes = int((query_start_loc[1:] - query_start_loc[:-1] == 1).sum())
            kind = STEP_KINDS[0] if decodes == seq_lens.numel() else STEP_KINDS[2] if decodes == 0 else STEP_KINDS[1]
            self.seconds[kind] += time.perf_counter() - start
            return out

        return timed

    @contextmanager
    def installed(self):
        """Both implementations wrapped where kernels/dispatch.py picks them (engines built inside)."""
        with ExitStack() as stack:
            for name in ("paged_attention_ref", "paged_attention_cpu"):
                stack.enter_context(mock.patch.object(dispatch, name, self.wrap(getattr(dispatch, name))))
            yield


def engine_table(dtype: str, requests: int, rounds: int) -> list[str]:
    probe = LLMEngine(dtype=dtype, num_kv_blocks=64)
    work = offline_workload(probe.model_config.vocab_size)[:requests]
    del probe
    rates: dict[str, list[float]] = {"torch": [], "cpu": []}
    clocks: dict[str, list[AttentionClock]] = {backend: [] for backend in rates}
    order = list(rates)
    for round_index in range(1, rounds + 1):
        for backend in order:
            clock = AttentionClock()
            with clock.installed():
                row = run_pagedserve(work, dtype, "inflight", 64, progress=False, attention_backend=backend)
            rates[backend].append(row.tokens_per_s)
            clocks[backend].append(clock)
            print(f"[round {round_index}/{rounds}] attention_backend={backend}: {row.output_tokens} tokens in "
                  f"{row.seconds:.1f} s, {row.tokens_per_s:.1f} tok/s, attention "
                  f"{sum(clock.seconds.values()):.1f} s", file=sys.stderr, flush=True)
        order.reverse()
    base = statistics.median(rates["torch"])
    lines = ["| attention_backend | runs, output tok/s | median tok/s | vs torch | attention s, median: "
             + " / ".join(STEP_KINDS) + " |", "|---|---|---:|---:|---:|"]
    for backend, values in rates.items():
        median = statistics.median(values)
        split = " / ".join(f"{statistics.median(c.seconds[k] for c in clocks[backend]):.2f}" for k in STEP_KINDS)
        lines.append(f"| {backend} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {median / base:.2f}x | "
                     f"{split} |")
    lines.append(f"\n{requests} requests ({sum(w.output_len for w in work)} output tokens), dtype {dtype}; "
                 "attention seconds include the warm-up requests.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=None, help="kernel: 7; engine: 3")
    parser.add_argument("--engine", action="store_true", help="whole-engine comparison instead of the kernel table")
    parser.add_argument("--requests", type=int, default=32, help="--engine: requests of the offline workload")
    args = parser.parse_args()
    keep_freed_memory_in_heap()  # as the engine does: large freed buffers stay in the heap
    print(machine(), file=sys.stderr, flush=True)
    if args.engine:
        lines = engine_table(args.dtype, args.requests, args.rounds or 3)
    else:
        lines = kernel_table(getattr(torch, args.dtype), args.rounds or 7)
    print("\n".join([machine(), "", *lines]))


if __name__ == "__main__":
    main()
