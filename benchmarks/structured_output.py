"""What a structured output costs: decode at 32 streams with every request constrained
against the same requests unconstrained, how long a grammar takes to compile, and what a
new schema's compile does to its own time to first token and to the streams running beside
it (through the engine thread, as the served model submits).

    python benchmarks/structured_output.py [--streams 32] [--tokens 64] [--rounds 3]

Engine alone (no server), the bundled model, its default dtype. The constrained requests
follow a regex of exactly 2,000 lowercase letters and spaces, so none completes before
`--tokens` and both runs decode the same number of steps (ignore_eos); so do those that follow
a JSON schema of 400 or more objects, once after a prompt the JSON is foreign to and once after
one that shows its format. Rounds alternate the runs. The goal: the mask costs at most 5% of a
decode step at 32 streams. The last column is the share of draws that broke the grammar and
were masked and drawn again (the sampler masks no other row).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import machine  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams, sampler  # noqa: E402
from pagedserve.backend.engine_thread import EngineThread  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                                           "point": {"type": "object", "properties": {"x": {"type": "number"}},
                                                     "required": ["x"]}},
          "required": ["name", "tags", "point"]}


LONG_JSON = {"type": "array", "minItems": 400, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["alpha", "beta", "gamma"]},
                                     "note": {"type": "string", "maxLength": 8}}, "required": ["id", "kind", "note"]}}
"""A JSON schema no answer completes within --tokens: every token is masked by the JSON's grammar."""
TOPIC = "Write about topic number {i}:"
SHOWN = ('Items for topic {i} as JSON: [{{"id": 1, "kind": "alpha", "note": "red"}}, {{"id": 2, "kind": "gamma", '
         '"note": "blue"}}, {{"id": 3, "kind": "beta", "note": "tall"}}]\nMore items for topic {i} as JSON: ')
"""Prompts: one the JSON's format is foreign to, one that shows it (as an application's would)."""
CASES = {"unconstrained": ({}, TOPIC),
         "every request constrained (regex)": ({"guided_regex": "[a-z ]{2000}"}, TOPIC),
         "every request constrained (JSON schema)": ({"guided_json": LONG_JSON}, TOPIC),
         "unconstrained, the JSON's format in the prompt": ({}, SHOWN),
         "every request constrained (JSON schema), its format in the prompt": ({"guided_json": LONG_JSON}, SHOWN)}
"""name: (sampling parameters added, prompt). Each compares with the unconstrained case of its prompt."""


class MaskedRows:
    """Counts the rows the sampler masks (backend/sampler.py masks a row only where its draw
    breaks the grammar), to show the share of draws that paid for a mask."""

    def __init__(self) -> None:
        self.count = 0
        self.mask = sampler.mask_logits
        sampler.mask_logits = self  # type: ignore[assignment]

    def __call__(self, logits, rows, matchers) -> None:
        self.count += len(rows)
        self.mask(logits, rows, matchers)


def run(engine: LLMEngine, streams: int, tokens: int, extra: dict, prompt: str) -> float:
    """Seconds for `streams` requests of `tokens` tokens each, all at once, each with `extra`."""
    params = [SamplingParams.from_dict({"max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": i, **extra})
              for i in range(streams)]
    prompts = [engine.encode(prompt.format(i=i)) for i in range(streams)]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == tokens for o in outputs), [len(o.token_ids) for o in outputs]
    return elapsed


def compile_while_serving(streams: int) -> list[tuple[str, float, float, float]]:
    """(request, ms in submit, TTFT ms, the running streams' longest token gap meanwhile ms)
    for requests submitted one by one while `streams` unconstrained streams decode: one
    unconstrained; the engine's first JSON schema (its compile and the vocabulary's tokenizer
    info, built once); that schema again (cached); two new schemas. The schemas are compact
    (vLLM's disable_any_whitespace), so the first token out is the first one generated: the
    renderer holds back a JSON's leading blank run until text follows it."""
    thread = EngineThread(lambda: LLMEngine(max_num_seqs=streams + 1))
    arrivals: dict[str, list[float]] = defaultdict(list)
    first = defaultdict(threading.Event)

    def record(request_id: str):
        def on_output(output) -> None:
            if output.new_token_ids:
                arrivals[request_id].append(time.perf_counter())
                first[request_id].set()
        return on_output

    def constrained(schema: dict) -> SamplingParams:
        return SamplingParams.from_dict({"max_tokens": 8, "structured_outputs": {"json": schema, "disable_any_whitespace": True}})

    prompt = thread.engine.encode("Write a long story about the sea:")
    for i in range(streams):
        thread.submit(f"bg{i}", prompt, SamplingParams.from_dict({"max_tokens": 100000, "ignore_eos": True,
                                                                   "temperature": 1.0, "seed": i}), record(f"bg{i}"))
    time.sleep(2.0)  # all streams decoding
    probes = [("unconstrained", SamplingParams.from_dict({"max_tokens": 8})),
              ("JSON schema, the engine's first", constrained(SCHEMA)),
              ("JSON schema, cached", constrained(SCHEMA))]
    for k in range(2):
        probes.append((f"JSON schema, new ({k + 1})",
                       constrained(SCHEMA | {"properties": SCHEMA["properties"] | {f"field_{k}": {"type": "integer"}}})))
    rows = []
    for index, (name, params) in enumerate(probes):
        start = time.perf_counter()
        thread.submit(f"probe{index}", prompt, params, record(f"probe{index}"))
        submitted = time.perf_counter()
        first[f"probe{index}"].wait(60)
        ttft = arrivals[f"probe{index}"][0] - start
        gaps = [b - a for i in range(streams) for a, b in zip(arrivals[f"bg{i}"], arrivals[f"bg{i}"][1:])
                if b >= start and a <= start + ttft]
        rows.append((name, 1000 * (submitted - start), 1000 * ttft, 1000 * max(gaps, default=0.0)))
        time.sleep(2.0)  # the probe done
    steady = [b - a for i in range(streams) for a, b in zip(arrivals[f"bg{i}"][5:40], arrivals[f"bg{i}"][6:41])]
    rows.append(("(the streams' median token gap, for scale)", 0.0, 0.0, 1000 * statistics.median(steady)))
    thread.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = LLMEngine(max_num_seqs=max(args.streams, 1))
    start = time.perf_counter()
    engine.check_admission(engine.encode("x"), SamplingParams.from_dict({"guided_json": SCHEMA}))
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    engine.check_admission(engine.encode("x"), SamplingParams.from_dict({"guided_json": SCHEMA}))
    cached = time.perf_counter() - start
    for extra, prompt in CASES.values():  # warm-up: grammars compiled, kernels and caches warm
        run(engine, args.streams, 8, extra, prompt)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    masked = MaskedRows()
    masked_share: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (extra, prompt) in CASES.items():
            before = masked.count
            times[name].append(run(engine, args.streams, args.tokens, extra, prompt))
            masked_share[name] = (masked.count - before) / (args.streams * args.tokens) if extra else 0.0
    medians = {name: statistics.median(values) for name, values in times.items()}
    plain = {prompt: medians[name] for name, (extra, prompt) in CASES.items() if not extra}
    print("\n" + machine() + f" dtype {engine.config.dtype} (resolved {engine.dtype}).")
    print(f"| {args.streams} streams x {args.tokens} tokens | median s (of {args.rounds}) | ms / step | tokens/s "
          "| vs unconstrained, same prompts | draws masked (last round) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.2f} | {1000 * seconds / args.tokens:.1f} | {args.streams * args.tokens / seconds:.0f} "
              f"| {100 * (seconds / plain[CASES[name][1]] - 1):+.1f}% | {masked_share[name]:.0%} |")
    print("\nthe goal: the mask costs at most +5% of a decode step")
    print(f"JSON schema compile: first {1000 * first_compile:.0f} ms (includes the vocabulary's tokenizer info), "
          f"again {1000 * cached:.2f} ms (cached)")
    del engine
    print(f"\nA request submitted while {args.streams} unconstrained streams decode (engine thread, as served):")
    print("| request | ms in submit (its compile) | TTFT ms | the streams' longest token gap meanwhile, ms |")
    print("|---|---:|---:|---:|")
    for name, submit_ms, ttft_ms, gap_ms in compile_while_serving(args.streams):
        print(f"| {name} | {submit_ms:.1f} | {ttft_ms:.0f} | {gap_ms:.0f} |")


if __name__ == "__main__":
    main()
