"""What speculative decoding (`speculative_config`, backend/spec_decode/) buys, n-gram or a draft
model, side by side in one run: the bundled model with its real weights, greedy, speculation off and on, over three
workloads with fixed texts (nothing is downloaded):

  edit   the model is asked to rewrite a given paragraph with its spelling corrected: the answer
         repeats much of the prompt (n-gram's case)
  code   the model is asked to continue a given Python file of repetitive structure
  chat   free questions: drafts rarely help (what speculation costs when it does not pay)

Each at one stream (the requests one after another) and at 8 streams (8 requests in one batch),
with speculation off, on with `draft_length: fixed` (every request drafts up to k, vLLM's way) and
on with `draft_length: adaptive` (as many drafts as are expected to pay for their rows, from this
engine's measured step cost: backend/spec_decode/draft_length.py). Per row: output tok/s of each
and the ratios to off, the acceptance rate (accepted draft tokens over drafted ones) of each, and
the request-steps the adaptive engine held back from drafting (acceptance and held back: the last
of the row's runs; tok/s: the median of --repeats runs, interleaved). float32, where speculation's output
equals the plain run's token for token (checked every row).

With `--method draft_model` the drafts come from a draft model instead: by default the bundled
model's own Q4_1 GGUF run in bfloat16 (its quantized blocks kept: a quarter of bf16's bytes, an
eighth of the float32 target's) drafting for the float32 model dequantized from it; `--draft` and
`--draft-dtype` name another.

    python benchmarks/speculative.py [--method ngram|draft_model] [--k 4] [--lookup-min 1] [--lookup-max 3]
                                     [--draft PATH] [--draft-dtype bfloat16] [--max-tokens 128]
                                     [--disable-by-batch-size N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import machine  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402
from pagedserve.backend.model_files import default_model_path  # noqa: E402

PARAGRAPHS = [
    "The comittee met on tuesday to discus the new budjet. Every departmant presented its plan, and the "
    "chairman asked each of them to explain why the costs had risen since last year. The finance team "
    "said that the price of energy had doubled, while the sales team argued that more staff were needed.",
    "Our garden has three aple trees, a small pond and a vegetable patch. In the sumer we grow tomatos, "
    "beans and lettuce; in the autum we pick the apples and make juice. The pond is home to frogs and a "
    "family of ducks that visits every morning.",
    "The train to the coast leaves at nine oclock from platform four. Passengers should arive early, "
    "because the ticket office closes ten minutes before departure. Bicycles are alowed on the first and "
    "last carriage only.",
]
CODE = '''def area_of_square(side):
    """The area of a square with the given side."""
    return side * side


def area_of_rectangle(width, height):
    """The area of a rectangle with the given width and height."""
    return width * height


def area_of_triangle(base, height):
    """The area of a triangle with the given base and height."""
    return base * height / 2


def area_of_circle(radius):
'''
QUESTIONS = ["Why is the sky blue?", "Give me three ideas for a birthday party.",
             "What should I pack for a weekend of hiking?", "How do plants make their food?"]


def workloads() -> dict[str, list[list[dict]]]:
    """Each workload's conversations (8: the first ones repeat for the 8-stream rows)."""
    edit = [[{"role": "user", "content": f"Rewrite this text with the spelling corrected:\n\n{p}"}] for p in PARAGRAPHS]
    code = [[{"role": "user", "content": f"Continue this Python file with four more functions like these:\n\n{CODE}"}]]
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return {name: (convs * 8)[:8] for name, convs in (("edit", edit), ("code", code), ("chat", chat))}


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, streams: int) -> tuple[float, list, dict]:
    """(output tok/s, token ids per request, the speculation counters' increase) of the prompts,
    `streams` at a time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    before = engine.stats()
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), streams):
        outputs += engine.generate(prompts[i:i + streams], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = engine.stats()
    counters = {name: getattr(after, name) - getattr(before, name)
                for name in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_backed_off")}
    tokens = [list(o.token_ids) for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft", default="", help="draft_model: the draft's checkpoint (default: the bundled GGUF)")
    parser.add_argument("--draft-dtype", default="bfloat16", help="draft_model: the draft's dtype")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--lookup-max", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode per row, interleaved; the median is shown")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max, "disable_by_batch_size": args.disable_by_batch_size}
    if args.method == "draft_model":
        spec = {"method": "draft_model", "model": args.draft or default_model_path(), "dtype": args.draft_dtype,
                "num_speculative_tokens": args.k, "disable_by_batch_size": args.disable_by_batch_size}
    engines = {"off": LLMEngine(dtype="float32"),
               "fixed": LLMEngine(dtype="float32", speculative_config={**spec, "draft_length": "fixed"}),
               "adaptive": LLMEngine(dtype="float32", speculative_config={**spec, "draft_length": "adaptive"})}
    print(machine())
    print(f"speculative_config {spec}; greedy, at most {args.max_tokens} tokens a request, float32\n")
    print("| workload | streams | requests | off tok/s | fixed tok/s | fixed / off | adaptive tok/s | adaptive / off "
          "| acceptance fixed | acceptance adaptive | held back |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, convs in workloads().items():
        prompts = [engines["off"].encode(messages=c) for c in convs]
        for streams, count in ((1, 3), (8, 8)):
            for engine in engines.values():  # warm-up: the first requests of a fresh engine pay for more
                engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
            runs: dict[str, list] = {mode: [] for mode in engines}
            for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits every mode alike
                for mode, engine in engines.items():
                    runs[mode].append(run(engine, prompts[:count], args.max_tokens, streams))
            off = statistics.median(r[0] for r in runs["off"])
            row = [name, str(streams), str(count), f"{off:,.1f}"]
            rates, held = [], 0
            for mode in ("fixed", "adaptive"):
                on = statistics.median(r[0] for r in runs[mode])
                assert all(r[1] == runs["off"][0][1] for r in runs[mode]), f"{name}: speculation ({mode}) changed an answer"
                c = runs[mode][-1][2]
                drafted, accepted = c["spec_num_draft_tokens"], c["spec_num_accepted_tokens"]
                rates.append(f"{accepted / drafted:.0%} of {drafted}" if drafted else "-")
                row += [f"{on:,.1f}", f"{on / off:.2f}x"]
                held = c["spec_num_backed_off"]
            print("| " + " | ".join(row + rates + [str(held)]) + " |", flush=True)

if __name__ == "__main__":
    main()
