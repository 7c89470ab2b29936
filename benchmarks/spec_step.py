"""What a speculative verify step costs beside a plain decode step at batch 1, and n-gram drafting on
a repeated text: a section of benchmarks/gpu.py. The issue's ceiling: a verify of 4 drafts costs at
most 1.15x a one-token decode step (the most any proposer can then gain per step is 5 tokens for
1.15 steps).

One engine (random weights of the shape, bf16, as served: decode and verify CUDA graphs wherever
the engine turns them on; the verify is timed without its graph too), `speculative_config` n-gram
with k 4 and `draft_length: fixed`, one request (a 512-token random prompt) decoding:

  plain    its proposer gives nothing: each step decodes one token (a graph's replay on CUDA)
  verify   its proposer gives 4 drafts each step (the last token repeated; kept or not, every
           step verifies 5 rows)

Step time: `steps` consecutive engine steps, the device synchronized at the window's ends, their
mean. Then the real n-gram proposer on a prompt of one random sentence repeated (the output of a
random model follows it only as far as its weights make it): output tok/s with drafting and with
the proposer silenced, in turns, and the acceptance.

Last, a draft model (Llama-3.2-1B's shape for the 8B, random weights, so only its cost is
measured): a drafting step of K drafts and its verify against the plain step, and the draft's own
forwards.

On CPU (the dry run: a tiny model) the plumbing runs, the numbers mean nothing.

    python benchmarks/spec_step.py [--device cpu] [--shape llama-3-8b]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import write_model_dir  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402

K = 4
CEILING = 1.15
"""A verify of K drafts against a one-token decode step, at batch 1 (the issue's target)."""


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_of(directory: str, device: str, speculative_config: dict) -> LLMEngine:
    """The section's engine: random weights of the shape, bf16, as served (graphs where the engine
    turns them on), no prefix cache, a small KV cache."""
    return LLMEngine(model=directory, load_format="dummy", device=device, dtype="bfloat16",
                     speculative_config={"num_speculative_tokens": K, "draft_length": "fixed", **speculative_config},
                     enable_prefix_caching=False, gpu_memory_utilization=0.55, kv_cache_bytes=64 * 2**20,
                     max_model_len=4096)


def random_prompt(engine: LLMEngine, rng: random.Random, length: int = 512) -> list[int]:
    return [rng.randrange(2, engine.model_config.vocab_size) for _ in range(length)]


def mean_step_ms(engine: LLMEngine, device: str, prompt: list[int], steps: int,
                 warmed: Callable[[], None] = lambda: None) -> float:
    """The mean of `steps` engine steps of one request decoding, after its prompt and three warm
    steps (then `warmed()` is called); aborted after."""
    request = engine.add_request(prompt, SamplingParams(max_tokens=(K + 1) * (steps + 8), temperature=0, ignore_eos=True))
    for _ in range(4):  # the prompt, then warm steps
        engine.step()
    warmed()
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    seconds = time.perf_counter() - started
    engine.abort(request)
    return seconds / steps * 1000


def rows(directory: str, device: str, steps: int = 32, tokens: int = 128,
         progress: Callable[[str], None] = print, draft_directory: str | None = None) -> dict:
    """The section's numbers (see the module's docstring); with `draft_directory`, a draft model's
    drafting step too (draft_rows)."""
    engine = engine_of(directory, device, {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    speculator = engine.speculator
    assert speculator is not None
    lookup = speculator.propose
    mode = {"drafts": "none"}

    def propose(seq, cap):
        if mode["drafts"] == "forced":
            return [seq.token_ids[-1]] * min(cap, K)
        return lookup(seq, cap) if mode["drafts"] == "ngram" else []

    speculator.propose = propose  # type: ignore[method-assign]
    rng = random.Random(0)
    prompt = random_prompt(engine, rng)

    def step_ms(drafts: str) -> float:
        mode["drafts"] = drafts
        return mean_step_ms(engine, device, prompt, steps)

    step_ms("none"), step_ms("forced")  # warm both paths (graphs, kernels' first calls)
    plain = min(step_ms("none") for _ in range(2))
    verify = min(step_ms("forced") for _ in range(2))
    verify_graphs = getattr(engine.runner, "verify_graphs", None)
    verify_eager = verify
    if verify_graphs is not None:  # the same verify without its graph, for what the graph spares
        engine.runner.verify_graphs = None
        verify_eager = min(step_ms("forced") for _ in range(2))
        engine.runner.verify_graphs = verify_graphs
    progress(f"speculative steps: plain {plain:.2f} ms, verify of {K} drafts {verify:.2f} ms ({verify / plain:.2f}x)")

    sentence = random_prompt(engine, rng, 24)
    repeated = sentence * 8
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {"none": [], "ngram": []}
    drafted = accepted = 0
    for _ in range(2):
        for drafts in ("none", "ngram"):
            mode["drafts"] = drafts
            before = engine.stats()
            sync(device)
            started = time.perf_counter()
            output = engine.generate([repeated], params, use_tqdm=False)[0]
            sync(device)
            rates[drafts].append(len(output.token_ids) / (time.perf_counter() - started))
            after = engine.stats()
            drafted += after.spec_num_draft_tokens - before.spec_num_draft_tokens
            accepted += after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    off, on = max(rates["none"]), max(rates["ngram"])
    progress(f"n-gram on a repeated text: {on:.1f} tok/s against {off:.1f} ({on / off:.2f}x), "
             f"{accepted} of {drafted} drafts accepted")
    row = dict(device=device, shape=os.path.basename(os.path.normpath(directory)),
               graphs=getattr(engine.runner, "graphs", None) is not None, verify_graphs=verify_graphs is not None,
               plain_step_ms=round(plain, 3), verify_step_ms=round(verify, 3), verify_eager_step_ms=round(verify_eager, 3),
               verify_over_plain=round(verify / plain, 3), ngram_tok_s=round(on, 1),
               off_tok_s=round(off, 1), ngram_over_off=round(on / off, 3), drafted=drafted, accepted=accepted)
    engine.close()
    if draft_directory is not None:
        row.update(draft_rows(directory, draft_directory, device, steps, plain, progress))
    return row


def draft_rows(directory: str, draft_directory: str, device: str, steps: int, plain_ms: float,
               progress: Callable[[str], None] = print) -> dict:
    """What a draft model's drafting step costs (random weights: its drafts are rejected, so every
    step drafts K and verifies K + 1 rows and keeps one token; the cost alone is measured): the step,
    the draft's one-token forwards (decode graphs of its own on CUDA) and its first forward of each
    step (the request's tokens since it last drafted)."""
    engine = engine_of(directory, device, {"method": "draft_model", "model": draft_directory})
    draft = engine.speculator.draft
    calls: list[list[tuple[int, float]]] = []  # each drafting step's forwards: (tokens, seconds)
    propose = draft.propose

    def recording(batch, counts):
        drafts = propose(batch, counts)
        calls.append(list(draft.forwards))
        return drafts

    draft.propose = recording
    step_ms = mean_step_ms(engine, device, random_prompt(engine, random.Random(1)), steps, warmed=calls.clear)
    one = sorted(seconds for call in calls for _, seconds in call[1:]) or [0.0]
    first = sorted(call[0][1] for call in calls if call) or [0.0]
    graphs = getattr(draft.runner, "graphs", None) is not None
    engine.close()
    progress(f"draft model: a drafting step {step_ms:.2f} ms ({step_ms / plain_ms:.2f}x the plain step), its one-token "
             f"forward {one[len(one) // 2] * 1000:.2f} ms")
    return dict(draft_shape=os.path.basename(os.path.normpath(draft_directory)).removeprefix("draft-"), draft_graphs=graphs,
                draft_step_ms=round(step_ms, 3), draft_over_plain=round(step_ms / plain_ms, 3),
                draft_forward_ms=round(one[len(one) // 2] * 1000, 3),
                draft_first_forward_ms=round(first[len(first) // 2] * 1000, 3))


def markdown(row: dict) -> str:
    note = "" if row["device"] == "cuda" else " (CPU dry run: the numbers mean nothing)"
    graphs = ("decode and verify steps replay CUDA graphs" if row.get("verify_graphs") else
              "decode steps replay CUDA graphs; a verify step runs eager") if row["graphs"] else "every step eager"
    return "\n".join([
        f"Speculative decoding at batch 1{note}: n-gram, k {K}, {graphs}.", "",
        "| plain decode step (ms) | verify of 4 drafts (ms) | the same verify eager (ms) | verify / plain | ceiling "
        "| n-gram on a repeated text (tok/s) | off (tok/s) | n-gram / off | accepted drafts |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {row['plain_step_ms']} | {row['verify_step_ms']} | {row['verify_eager_step_ms']} | {row['verify_over_plain']:.2f}x "
        f"| {CEILING}x "
        f"| {row['ngram_tok_s']:,} | {row['off_tok_s']:,} | {row['ngram_over_off']:.2f}x "
        f"| {row['accepted']} of {row['drafted']} |",
        *([] if "draft_step_ms" not in row else [
            "", f"A draft model ({row['draft_shape']}'s shape, random weights: the cost alone) drafting {K} a step at batch 1: "
            f"the step {row['draft_step_ms']} ms, {row['draft_over_plain']:.2f}x the plain decode step (so drafts pay from "
            f"{row['draft_over_plain'] - 1:.2f} accepted a step on average); the draft's one-token forward "
            f"{row['draft_forward_ms']} ms ({'its decode graphs' if row['draft_graphs'] else 'eager'}), its first forward "
            f"of a step {row['draft_first_forward_ms']} ms."]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="", help="a benchmarks/model_shapes.py shape (default: llama-3-8b on CUDA, "
                                                    "tiny on CPU)")
    args = parser.parse_args()
    shape = args.shape or ("llama-3-8b" if args.device == "cuda" else "tiny")
    draft_shape = "llama-3.2-1b" if args.device == "cuda" else "tiny"
    with tempfile.TemporaryDirectory() as root:
        row = rows(write_model_dir(shape, os.path.join(root, shape)), args.device,
                   draft_directory=write_model_dir(draft_shape, os.path.join(root, f"draft-{draft_shape}")))
    print(markdown(row))


if __name__ == "__main__":
    main()
