"""What `deterministic` (batch-invariant greedy) costs, and whether it holds: decode speed with it
and without, one stream and a batch, engines side by side in one process (rounds alternate), and
for each engine whether one greedy request's tokens are the same alone and beside 15 others of
other lengths.

    python benchmarks/deterministic.py [--dtypes float32,bfloat16] [--streams 16] [--tokens 64] [--rounds 3]
    python benchmarks/deterministic.py --device cuda --model DIR --load-format dummy --dtypes bfloat16

Engine alone (no server); the bundled model by default. On CPU its GGUF-exact weights are where
the setting changes a kernel (backend/config.py's `deterministic`); on a GPU it swaps the GEMMs,
norms, attention and logprobs for the batch-invariant Triton launches (backend/batch_invariant.py).
benchmarks/gpu.py runs `rows` on the bundled model's shape as one of its sections.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from single_stream import time_single_stream
from workload import machine

from pagedserve.backend import LLMEngine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def batch_rate(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    """Output tokens/s of greedy requests of `tokens` tokens each, all at once."""
    start = time.perf_counter()
    engine.generate(prompts, [SamplingParams(max_tokens=tokens, **GREEDY)] * len(prompts), use_tqdm=False)
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return len(prompts) * tokens / (time.perf_counter() - start)


def first_difference(engine: LLMEngine, target: list[int], others: list[list[int]], tokens: int) -> int | None:
    """The index of the first token where `target`'s greedy output beside `others` differs from its
    output alone; None where the two are the same."""
    params = SamplingParams(max_tokens=tokens, **GREEDY)
    alone = engine.generate([target], params, use_tqdm=False)[0].token_ids
    beside = engine.generate([*others[:7], target, *others[7:]], params, use_tqdm=False)[7].token_ids
    return next((i for i, (a, b) in enumerate(zip(alone, beside)) if a != b), None)


def rows(model: str = "", device: str = "cpu", dtype: str = "bfloat16", load_format: str = "auto",
         streams: int = 16, tokens: int = 64, rounds: int = 3, label: str = "") -> list[dict]:
    """One row per setting (off, on): medians over `rounds` of one stream's decode rate and `streams`
    requests' output rate, the cost against off, and where a request's tokens first differ beside
    others (None: nowhere in `tokens`)."""
    settings = dict(model=model, device=device, dtype=dtype, load_format=load_format, enable_prefix_caching=False,
                    max_num_seqs=max(streams, 16), num_kv_blocks=4096)
    engines = {mode: LLMEngine(**settings, deterministic=mode) for mode in (False, True)}
    vocab = engines[False].model_config.vocab_size
    rng = random.Random(0)
    prompt_of = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    prompt = prompt_of(32)
    batch = [prompt_of(16 + 8 * i) for i in range(streams)]
    target, others = prompt_of(100), [prompt_of(20 + 19 * i) for i in range(15)]
    single: dict[bool, list[float]] = {False: [], True: []}
    many: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for mode, engine in engines.items():
            def generate(p: list[int], n: int, engine: LLMEngine = engine) -> None:
                engine.generate([p], SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)
            single[mode].append(time_single_stream(generate, prompt, tokens, repeats=2)[1])
            many[mode].append(batch_rate(engine, batch, tokens))
        print(f"  {dtype} round {round_ + 1}/{rounds} done", file=sys.stderr, flush=True)
    out = []
    for mode, engine in engines.items():
        out.append(dict(model=label or os.path.basename(model.rstrip("/")) or "bundled", dtype=dtype,
                        deterministic=mode, streams=streams, single_tok_s=round(statistics.median(single[mode]), 1),
                        batch_tok_s=round(statistics.median(many[mode]), 1),
                        differs_at=first_difference(engine, target, others, tokens)))
    for row in out:
        row["single_cost"] = round(out[0]["single_tok_s"] / row["single_tok_s"] - 1, 3)
        row["batch_cost"] = round(out[0]["batch_tok_s"] / row["batch_tok_s"] - 1, 3)
    for engine in engines.values():
        engine.close()
    del engines
    gc.collect()
    return out


def markdown(table: list[dict]) -> str:
    """Cost is the extra time per token against off."""
    if not table:
        return ""
    n = table[0]["streams"]
    lines = [f"| model | dtype | deterministic | one stream tok/s | {n} streams tok/s | cost, one stream | cost, {n} streams "
             "| alone vs beside 15 others |", "|---|---|---|---:|---:|---:|---:|---|"]
    for r in table:
        cost = (f"{r['single_cost']:+.0%} | {r['batch_cost']:+.0%}") if r["deterministic"] else " | "
        same = "same tokens" if r["differs_at"] is None else f"differs from token {r['differs_at']}"
        lines.append(f"| {r['model']} | {r['dtype']} | {'on' if r['deterministic'] else 'off'} | {r['single_tok_s']} "
                     f"| {r['batch_tok_s']} | {cost} | {same} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="", help="model directory (default: the bundled model)")
    parser.add_argument("--load-format", default="auto", help="'dummy': random weights of the directory's shape")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    table = []
    for dtype in args.dtypes.split(","):
        table += rows(args.model, args.device, dtype, args.load_format, args.streams, args.tokens, args.rounds)
    print(markdown(table))


if __name__ == "__main__":
    main()
