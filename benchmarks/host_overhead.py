"""Host overhead: CPU time per engine step spent outside the model's forward.

On a GPU a decode step of an 8B model takes ~5 ms at the bandwidth roofline; whatever the
host does around it (scheduling, input preparation, sampling bookkeeping, applying the
output, rendering text) either hides behind that or adds to it. This measures that host
work on the CPU, with the forward replaced by a stand-in that returns logits of the right
shape at once, at 1, 64 and 256 running requests (all decoding), and splits it by phase.

    python benchmarks/host_overhead.py [--running 1,64,256] [--steps 200] [--path gpu|cpu]

--path gpu (default) is the host's side of a CUDA engine: decode steps through the decode
graphs' static buffers and persistent rows (backend/cuda_graphs.py, replayed here with the
stand-in instead of a graph) and async scheduling; --path cpu the CPU engine's step (inputs
planned and copied each step, synchronous). The model is a tiny random one (its forward is
replaced anyway); the vocabulary is small, so the stand-in's argmax costs nothing a GPU
would not do on its side. Goal (the GPU issue): at most 0.3 ms a step at 1 request and 2 ms
at 256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from collections import defaultdict
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import write_model_dir  # noqa: E402
from workload import machine  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402

PHASES = ("schedule", "prepare", "sample", "update", "render")


class PhaseClock:
    """Wall time per phase over the current step, exclusive: a timed call inside another
    (the stand-in forward inside the decode graphs' run) counts for its own phase only."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []

    def wrap(self, phase: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            self._inner.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.step[phase] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return timed


def stand_in_forward(vocab: int) -> Callable:
    """Logits [rows, vocab] where token 3 + (row % 7) wins: the real forward's output shape."""
    cache: dict[int, torch.Tensor] = {}

    def run(inputs, *args, **kwargs) -> torch.Tensor:
        rows = len(inputs.logits_indices)
        if rows not in cache:
            logits = torch.zeros(rows, vocab)
            logits[torch.arange(rows), 3 + torch.arange(rows) % 7] = 1.0
            cache[rows] = logits
        return cache[rows]

    return run


def measure(engine: LLMEngine, clock: PhaseClock, running: int, steps: int, final_only: bool = False) -> dict[str, float]:
    """Median ms per phase (and in all) over `steps` decode steps at `running` requests
    (final_only: requests as `generate` adds them, rendered once at the end)."""
    params = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
    for i in range(running):
        engine.add_request([5 + (i + j) % 400 for j in range(32)], params, final_only=final_only)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.requests.values()):
        engine.step()  # prompts in
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        clock.step.clear()
        start = time.perf_counter()
        engine.step()
        samples["total"].append(time.perf_counter() - start - clock.step.pop("forward", 0.0))
        for phase in PHASES:
            samples[phase].append(clock.step.get(phase, 0.0))
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    return {phase: statistics.median(values) * 1000 for phase, values in samples.items()}


def instrument(engine: LLMEngine, path: str) -> PhaseClock:
    clock = PhaseClock()
    runner = engine.runner
    forward = stand_in_forward(engine.model_config.vocab_size)
    runner.run = clock.wrap("forward", forward)
    if path == "gpu":  # the decode graphs' host side over CPU buffers, the graph itself the stand-in
        from pagedserve.backend.cuda_graphs import DecodeGraphs

        graphs = runner.graphs = DecodeGraphs(runner, engine.config.max_num_seqs, engine.max_model_len)
        graphs.capture()
        graphs._forward = clock.wrap("forward", lambda rows, context: forward(SimpleNamespace(logits_indices=range(rows))))
        graphs.run = clock.wrap("prepare", graphs.run)
        engine.async_scheduling = True
    runner.plan = clock.wrap("prepare", runner.plan)
    runner.to_inputs = clock.wrap("prepare", runner.to_inputs)
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = clock.wrap("update", engine.scheduler.update_from_output)
    engine.sampler.sample = clock.wrap("sample", engine.sampler.sample)
    engine._render = clock.wrap("render", engine._render)
    return clock


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--path", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--tokenizer", default="byte-level", choices=["byte-level", "word"],
                        help="byte-level BPE (Llama 3's, Qwen's, SmolLM's kind; default) or a word-level one")
    parser.add_argument("--final-only", action="store_true",
                        help="requests as offline generate adds them (text rendered once, at the end)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.running.split(",")]
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine(model=write_model_dir("tiny", os.path.join(root, "tiny"), args.tokenizer), load_format="dummy",
                           device="cpu", dtype="float32", compile="off", max_num_seqs=max(counts),
                           max_num_batched_tokens=max(2048, 32 * max(counts)), num_kv_blocks=64 * max(counts) + 64,
                           enable_prefix_caching=True)
        clock = instrument(engine, args.path)
        rows = []
        for running in counts:
            timings = measure(engine, clock, running, args.steps, args.final_only)
            rows.append(dict(running=running, **timings))
    print("\n" + machine() + f" Host path: {args.path}{', final-only outputs' if args.final_only else ''}; "
          f"{args.tokenizer} tokenizer.")
    print("| running requests | host ms / step | " + " | ".join(PHASES) + " | other |")
    print("|---:|---:|" + "---:|" * (len(PHASES) + 1))
    for row in rows:
        other = row["total"] - sum(row[p] for p in PHASES)
        print(f"| {row['running']} | {row['total']:.3f} | " + " | ".join(f"{row[p]:.3f}" for p in PHASES) + f" | {other:.3f} |")
    return rows


if __name__ == "__main__":
    main()
