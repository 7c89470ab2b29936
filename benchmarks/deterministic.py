"""What `deterministic` (batch-invariant greedy) costs: decode speed with it and without, one
stream and a batch, each dtype, engines side by side in one process (rounds alternate).

    python benchmarks/deterministic.py [--dtypes float32,bfloat16] [--streams 16] [--tokens 64] [--rounds 3]

Engine alone (no server), the bundled model. Its GGUF-exact weights are where the setting
changes a kernel: float32 sums a few rows' GGUF blocks in the many-row order, half precision
multiplies the rounded weight at every row count (backend/config.py's `deterministic`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from single_stream import time_single_stream
from workload import machine

from pagedserve.backend import LLMEngine, SamplingParams


def batch_rate(engine: LLMEngine, streams: int, tokens: int) -> float:
    """Output tokens/s of `streams` greedy requests of `tokens` tokens each, all at once."""
    prompts = [engine.encode(f"Write about topic number {i}:") for i in range(streams)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, [params] * streams, use_tqdm=False)
    return streams * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    n = args.streams
    print(f"| dtype | deterministic | one stream tok/s | {n} streams tok/s | cost, one stream | cost, {n} streams |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        engines = {mode: LLMEngine(dtype=dtype, deterministic=mode, enable_prefix_caching=False) for mode in (False, True)}
        prompt = engines[False].encode("Describe a walking tour of Paris, with its famous monuments, in detail.")
        single: dict[bool, list[float]] = {False: [], True: []}
        batch: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for mode, engine in engines.items():
                def generate(p: list[int], n: int, engine: LLMEngine = engine) -> None:
                    engine.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
                single[mode].append(time_single_stream(generate, prompt, args.tokens, repeats=2)[1])
                batch[mode].append(batch_rate(engine, args.streams, args.tokens))
            print(f"  {dtype} round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        s = {mode: statistics.median(v) for mode, v in single.items()}
        b = {mode: statistics.median(v) for mode, v in batch.items()}
        print(f"| {dtype} | off | {s[False]:.1f} | {b[False]:.1f} | | |")
        print(f"| {dtype} | on | {s[True]:.1f} | {b[True]:.1f} | {s[False] / s[True] - 1:+.0%} | {b[False] / b[True] - 1:+.0%} |")
        del engines


if __name__ == "__main__":
    main()
