"""The one command for a lent GPU: the device's limits, pagedserve at real model sizes, the
peer the GPU machine has, each target's PASS / FALLS SHORT, in one run.

    python benchmarks/gpu.py --out DIR            # a GPU, at most ~8 minutes
    python benchmarks/gpu.py --out DIR --quick    # a GPU, at most ~4 minutes
    python benchmarks/gpu.py --device cpu --quick --out DIR   # the same code on a tiny shape (make test)

Models have random weights of a real shape, drawn on the device (`load_format: dummy`;
nothing is downloaded) and outputs are forced with `ignore_eos`, so speed does not depend
on the values. Per model: single-stream decode (128-token prompt, 256 generated) and its
share of the bandwidth roofline (bytes a step must read, weights plus KV, over the step
time, over the copy bandwidth measured in this run); TTFT of a 2,048-token prompt; offline
output tok/s with 256 requests in flight (ShareGPT-like lengths, fixed seed). First, after the
device's own limits, Llama-3-8B's linear shapes at M = 1 to 256 through our bf16 path (cuBLAS), our
fp8 and int4 Triton GEMMs and beside them the vendor's (torch._scaled_mm, torch's int4 tinygemm):
time, weight GB/s and its share of the copy bandwidth, ours against the vendor's
(benchmarks/kernel_table.py); then one layer of Mixtral's and Qwen3-MoE's experts through the
fused MoE kernel and the torch reference (benchmarks/moe_kernel.py); then the batched LoRA delta
on Llama-3-8B's linears and what mixing 4 adapters costs the bundled model's shape at 32 streams
(benchmarks/lora.py). After the models, a torch.profiler view of the 8B bf16 engine's steps
(decode at batch 1, 64 and 256, and 8 decodes beside a 2,048-token prefill): device time by
kernel family and the device's idle time between kernels, the host's share
(benchmarks/step_profile.py); what a speculative verify step costs beside a decode step at batch 1
(with and without its graph), n-gram drafting on a repeated text and a 1B draft model's drafting
step (benchmarks/spec_step.py); a one-image request's time to first
token on Qwen2.5-VL-3B's shape, the encoder alone and the caches' hits (benchmarks/vision.py); last,
what `deterministic` costs the bundled model's shape and whether a request's tokens stay the same
beside others, with it and without (benchmarks/deterministic.py). The peer is
transformers on the same shape and requests: continuous batching (`generate_batch`'s
manager, paged attention) for throughput, static-cache compiled `generate` for one stream.

Every section runs against one deadline (--budget): one that would not fit is skipped and
says so, and the table is written whatever happened, so a lease is never spent for nothing.
Writes DIR/gpu.json and DIR/gpu.md; the table is printed last.

The 8B bf16 model is also served (our model repository under tritonserver, 64 gRPC
streams, closed loop) beside the same requests offline at the same concurrency. A lent
GPU machine has no tritonserver, no numpy 1 and no tritonclient: pack them here with
`bash benchmarks/gpu_bundle.sh pack` (into .gpu/, ~51 MB), carry `.gpu` with the call and
begin it with `bash benchmarks/gpu_bundle.sh install`; without them the served section
fails and says why, and the rest runs (--skip-served leaves it out).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import write_model_dir  # noqa: E402
from lora import kernel_rows as lora_kernel_rows, markdown as lora_markdown, mix_rows as lora_mix_rows  # noqa: E402
from moe_kernel import markdown as moe_markdown, moe_rows  # noqa: E402
from deterministic import markdown as deterministic_markdown, rows as deterministic_rows  # noqa: E402
from kernel_table import kernel_rows, markdown as kernel_markdown, slowest_vs_vendor  # noqa: E402
from step_profile import markdown as step_profile_markdown, rows as step_profile_rows  # noqa: E402
from spec_step import CEILING as SPEC_CEILING, markdown as spec_markdown, rows as spec_rows  # noqa: E402
from vision import build_checkpoint as vision_checkpoint, markdown as vision_markdown, rows as vision_rows  # noqa: E402


def importable_checkout() -> None:
    """Make `pagedserve` importable from this checkout where it is not installed (a lent GPU
    machine runs the image's own Python): the package's folders linked under a temporary
    `pagedserve/`, as pyproject.toml's package-dir maps them."""
    try:
        import pagedserve.backend  # noqa: F401
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        package = os.path.join(tempfile.mkdtemp(prefix="pagedserve-src-"), "pagedserve")
        os.makedirs(package)
        for name in ("backend", "kernels", "client"):
            os.symlink(os.path.join(root, name), os.path.join(package, name))
        sys.path.insert(0, os.path.dirname(package))


importable_checkout()
from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402


@dataclass(frozen=True)
class ModelRun:
    label: str
    shape: str
    quantization: str = "none"
    peer: bool = False
    """Also run transformers on this model."""
    served: bool = False
    """Also serve it through tritonserver (gRPC streams) beside the same requests offline."""


@dataclass
class Plan:
    """What one run measures: sizes shrink for --quick and for the CPU dry run."""

    runs: list[ModelRun]
    single_prompt: int = 128
    single_output: int = 256
    ttft_prompt: int = 2048
    offline_requests: int = 1000
    """Requests in the offline run; at most `in_flight` run at once (vLLM's offline benchmark
    sends 1,000 ShareGPT requests): with as many requests as slots, the run would end in a
    long tail of the longest outputs at a shrinking batch."""
    in_flight: int = 256
    batched_tokens: int = 8192
    """The step's token budget (max_num_batched_tokens), as vLLM sets it for an H100."""
    served_streams: int = 64
    served_requests: int = 256
    prompt_median: int = 180
    output_median: int = 160
    max_len: int = 1024
    copy_bytes: int = 2 * 2**30
    matmul_size: int = 8192
    budget_s: float = 480.0


def make_plan(device: str, quick: bool, budget: float | None) -> Plan:
    if device == "cpu":
        plan = Plan([ModelRun("tiny bf16", "tiny", peer=True, served=True), ModelRun("tiny fp8", "tiny", "fp8"),
                     ModelRun("tiny int4", "tiny", "int4")],
                    single_prompt=16, single_output=16, ttft_prompt=64, offline_requests=12, in_flight=8, batched_tokens=64,
                    served_streams=4, served_requests=8, prompt_median=24, output_median=12, max_len=96,
                    copy_bytes=2**24, matmul_size=256, budget_s=300.0)
    elif quick:
        plan = Plan([ModelRun("Llama-3-8B bf16", "llama-3-8b", peer=True), ModelRun("Llama-3-8B fp8", "llama-3-8b", "fp8"),
                     ModelRun("Llama-3-8B int4", "llama-3-8b", "int4"), ModelRun("SmolLM2-135M bf16", "smollm2-135m")],
                    single_output=128, offline_requests=512, budget_s=230.0)
    else:
        plan = Plan([ModelRun("Llama-3-8B bf16", "llama-3-8b", peer=True, served=True),
                     ModelRun("Llama-3-8B fp8", "llama-3-8b", "fp8"), ModelRun("Llama-3-8B int4", "llama-3-8b", "int4"),
                     ModelRun("SmolLM2-135M bf16", "smollm2-135m", peer=True)])
    if budget is not None:
        plan.budget_s = budget
    return plan


# -- the workload -------------------------------------------------------------------------

def sharegpt_like(vocab: int, count: int, prompt_median: int, output_median: int, max_len: int,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs with ShareGPT-like lengths: log-normal prompts and
    outputs (a long tail of long ones), each pair within max_len tokens."""
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        prompt = int(min(max(4, rng.lognormvariate(math.log(prompt_median), 0.8)), max_len // 2))
        output = int(min(max(4, rng.lognormvariate(math.log(output_median), 0.7)), max_len - prompt))
        work.append(([rng.randrange(3, vocab) for _ in range(prompt)], output))
    return work


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


# -- timing helpers ----------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_of(function: Callable[[], None], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        function()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def single_stream(generate: Callable[[list[int], int], None], prompt: list[int], output: int,
                  device: str, repeats: int = 2) -> tuple[float, float]:
    """(TTFT s, decode tok/s): a 1-token generate's time, and the extra tokens of a full
    generate over its extra time (best of `repeats` each, after a warm-up)."""
    generate(prompt, 2)
    first = best_of(lambda: generate(prompt, 1), repeats, device)
    full = best_of(lambda: generate(prompt, output), repeats, device)
    return first, (output - 1) / max(full - first, 1e-9)


# -- the device ----------------------------------------------------------------------------

def measure_device(device: str, plan: Plan) -> dict:
    """Name, copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        from workload import machine

        name, memory = machine(), 0
    n = plan.copy_bytes // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = best_of(lambda: dst.copy_(src), 10, device)
    del src, dst
    size = plan.matmul_size
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    a @ b
    matmul = best_of(lambda: a @ b, 10, device)
    del a, b
    release(device)
    return dict(name=name, memory_gib=round(memory / 2**30, 1), copy_gb_s=round(2 * n * 2 / copy / 1e9, 1),
                bf16_tflops=round(2 * size**3 / matmul / 1e12, 1))


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        try:
            from torch._inductor import cudagraph_trees

            cudagraph_trees.reset_cudagraph_trees()
        except Exception:  # noqa: BLE001 - only frees graphs' memory sooner
            pass
        torch.cuda.empty_cache()


# -- pagedserve ----------------------------------------------------------------------------

def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear (quantized ones in their packed
    form), the norms and the LM head; of the embedding only a row (not counted) unless the
    LM head shares it."""
    from pagedserve.backend.quantization import QuantizedLinear

    total, seen = 0, set()
    for name, module in model.named_modules():
        if name.endswith("embed_tokens"):
            continue
        if isinstance(module, QuantizedLinear):
            total += module.weight.nbytes
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(engine: LLMEngine) -> int:
    config = engine.model_config
    return 2 * config.num_layers * config.kv_size * torch.tensor([], dtype=engine.kv_dtype).element_size()


def run_pagedserve(run: ModelRun, directory: str, device: str, plan: Plan, deadline: Callable[[], float],
                   bandwidth: float) -> dict:
    row: dict = dict(system="pagedserve", model=run.label, quantization=run.quantization)
    started = time.perf_counter()
    engine = LLMEngine(model=directory, load_format="dummy", device=device, dtype="bfloat16",
                       quantization=run.quantization, max_num_seqs=plan.in_flight, enable_prefix_caching=False,
                       max_num_batched_tokens=plan.batched_tokens,
                       gpu_memory_utilization=0.55, kv_cache_bytes=16 * 2**20, max_model_len=4096)
    row["load_s"] = round(time.perf_counter() - started, 1)
    row.update(compiled=engine.runner.compiled is not None, decode_graphs=getattr(engine.runner, "graphs", None) is not None,
               async_scheduling=getattr(engine, "async_scheduling", False))
    vocab = engine.model_config.vocab_size
    progress(f"{run.label}: engine ready in {row['load_s']} s")

    def generate(prompt: list[int], max_tokens: int) -> None:
        engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)

    weight_bytes = decode_weight_bytes(engine.runner.model)
    ttft, decode = single_stream(generate, random_prompt(vocab, plan.single_prompt, 1), plan.single_output, device)
    context = plan.single_prompt + plan.single_output / 2
    step_bytes = weight_bytes + context * kv_bytes_per_token(engine)
    row.update(decode_tok_s=round(decode, 1), weight_gb=round(weight_bytes / 1e9, 2),
               roofline_tok_s=round(bandwidth / step_bytes, 1) if bandwidth else None,
               roofline_share=round(decode * step_bytes / bandwidth, 3) if bandwidth else None)
    progress(f"{run.label}: single stream {decode:.1f} tok/s")

    if deadline() > 20:
        long_prompt = random_prompt(vocab, plan.ttft_prompt, 2)
        generate(long_prompt, 1)
        row["ttft_2k_ms"] = round(best_of(lambda: generate(long_prompt, 1), 3, device) * 1000, 1)
        progress(f"{run.label}: TTFT of {plan.ttft_prompt} tokens {row['ttft_2k_ms']} ms")
    if deadline() > 30:
        work = sharegpt_like(vocab, plan.offline_requests, plan.prompt_median, plan.output_median, plan.max_len)
        row.update(offline_requests=len(work), offline_tok_s=offline_rate(engine, work, device))
        progress(f"{run.label}: offline {row['offline_tok_s']} tok/s ({len(work)} requests, {plan.in_flight} in flight)")
    if run.served and deadline() > 30:  # the served run's requests, offline at the served concurrency
        engine.scheduler.max_num_seqs = plan.served_streams
        row["offline_at_served_tok_s"] = offline_rate(engine, served_work(vocab, plan), device)
        engine.scheduler.max_num_seqs = plan.in_flight
    if run.served and deadline() > 30:
        row.update(grammar_mask_cost(engine, vocab, device))
    engine.close()
    del engine
    release(device)
    return row


def grammar_mask_cost(engine: LLMEngine, vocab: int, device: str, streams: int = 32, tokens: int = 64) -> dict:
    """Decode at `streams` streams with every request following a regex (2,000 letters and
    spaces: none ends early) against the same requests unconstrained: the grammar mask's share
    of a step. Needs xgrammar (a lent machine lacks it: `gpu_bundle.sh pack-grammar`)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return {}
    prompts = [random_prompt(vocab, 32, 100 + i) for i in range(streams)]

    def seconds(extra: dict) -> float:
        params = [SamplingParams.from_dict({"max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": i, **extra})
                  for i in range(streams)]
        sync(device)
        start = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        sync(device)
        return time.perf_counter() - start

    regex = {"guided_regex": "[a-z ]{2000}"}
    seconds(regex), seconds({})  # warm: the grammar compiled, its kernels loaded
    plain, masked = min(seconds({}) for _ in range(2)), min(seconds(regex) for _ in range(2))
    progress(f"grammar mask at {streams} streams: {100 * (masked / plain - 1):+.1f}% of a decode step")
    return {"grammar_mask_share": round(masked / plain - 1, 3)}


# -- the peer: transformers ---------------------------------------------------------------

def offline_rate(engine: LLMEngine, work: list[tuple[list[int], int]], device: str) -> float:
    """Output tok/s of one generate of every request (queued at once)."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
    sync(device)
    start = time.perf_counter()
    results = engine.generate([p for p, _ in work], params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == sum(n for _, n in work), "offline: fewer tokens than asked for"
    return round(tokens / seconds, 1)


def served_work(vocab: int, plan: Plan) -> list[tuple[list[int], int]]:
    return sharegpt_like(vocab, plan.served_requests, plan.prompt_median, plan.output_median, plan.max_len, seed=1)


# -- served through tritonserver ----------------------------------------------------------

class TokenWorkload:
    """The load generator's requests for a word-level model directory: token i is "t<i>"."""

    def __init__(self, work: list[tuple[list[int], int]]):
        self.work = work

    def request(self, index: int):
        from pagedserve.client.loadgen import RequestSpec

        prompt, output = self.work[index % len(self.work)]
        return RequestSpec(index, " ".join(f"t{t}" for t in prompt), output, len(prompt))


def run_served(run: ModelRun, directory: str, device: str, plan: Plan, root: str) -> dict:
    """The model in our model repository under tritonserver, `served_streams` gRPC streams
    (closed loop) over the served requests: output tok/s, TTFT and ITL."""
    from pagedserve.client.loadgen import BenchConfig, run_benchmark
    from pagedserve.client.repository import write_repository
    from pagedserve.client.triton_server import TritonServer

    settings = dict(load_format="dummy", device=device, dtype="bfloat16", max_num_seqs=plan.served_streams,
                    max_num_batched_tokens=plan.batched_tokens,
                    enable_prefix_caching="false", gpu_memory_utilization=0.55, kv_cache_bytes=16 * 2**20,
                    max_model_len=4096)
    work = served_work(shape_vocab(directory), plan)
    logs = os.path.join(root, "served")
    repository = write_repository(os.path.join(logs, "model_repository"), model=directory, engine=settings)
    # `llm` alone: the gRPC streams speak to it, and the relays' and ensemble's stubs would
    # only lengthen the start (each model is a Python stub process).
    server = TritonServer(repository, log_file=os.path.join(logs, "tritonserver.log"), exit_timeout_s=5,
                          workdir=os.path.join(logs, "triton"), models=["llm"])
    started = time.perf_counter()
    server.start(timeout=300)
    progress(f"{run.label}: tritonserver ready in {time.perf_counter() - started:.0f} s")
    try:
        config = BenchConfig(url=server.grpc_url, protocol="grpc", num_requests=len(work), concurrency=plan.served_streams,
                             tokenizer=None, warmup=2, request_timeout=600)
        result = run_benchmark(config, TokenWorkload(work), progress=False)
    finally:
        server.cleanup()
    summary = result.summary
    if summary.num_ok != len(work) or summary.total_output_tokens != sum(n for _, n in work):
        raise RuntimeError(f"served: {summary.num_ok} of {len(work)} requests, {summary.total_output_tokens} tokens "
                           f"({summary.error_examples[:2]})")
    row = dict(system=f"pagedserve served, {plan.served_streams} gRPC streams", model=run.label, quantization="none",
               served_requests=len(work), served_tok_s=round(summary.output_tokens_per_s, 1),
               ttft_p50_ms=round(summary.ttft.p50 * 1000, 1), itl_p50_ms=round(summary.itl.p50 * 1000, 2))
    progress(f"{run.label}: served {row['served_tok_s']} tok/s at {plan.served_streams} streams")
    return row


def shape_vocab(directory: str) -> int:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)["vocab_size"]


def hf_model(directory: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def run_peer_batching(model, run: ModelRun, device: str, plan: Plan) -> dict:
    """transformers' continuous batching (paged attention) on the same requests, as many in
    flight. Not under our inference_mode: its background thread updates tensors the warm-up
    made, which inference tensors refuse."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    work = sharegpt_like(model.config.vocab_size, plan.offline_requests, plan.prompt_median, plan.output_median, plan.max_len)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(max_batch_tokens=plan.batched_tokens, max_requests_per_batch=plan.in_flight)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    if device == "cuda":
        manager.warmup()
    manager.start()
    try:
        sync(device)
        start = time.perf_counter()
        ids = [manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1) for prompt, n in work]
        tokens, finished = 0, 0
        while finished < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped answering")
            if result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    if tokens != sum(n for _, n in work):
        raise RuntimeError(f"transformers' continuous batching returned {tokens} of {sum(n for _, n in work)} tokens")
    row = dict(system="transformers continuous batching", model=run.label, quantization="none",
               offline_requests=len(work), offline_tok_s=round(tokens / seconds, 1))
    progress(f"{run.label}: transformers continuous batching {row['offline_tok_s']} tok/s")
    return row


@torch.inference_mode()
def run_peer_single(model, run: ModelRun, device: str, plan: Plan) -> dict:
    """transformers' static-cache generate, compiled (its own default on CUDA), one stream."""
    from transformers import GenerationConfig

    prompt = torch.tensor([random_prompt(model.config.vocab_size, plan.single_prompt, 1)], device=device)

    def generate(_: list[int], max_tokens: int) -> None:
        config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                  cache_implementation="static", eos_token_id=None, pad_token_id=0)
        model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)

    generate([], 8)  # compiles
    ttft, decode = single_stream(generate, [], plan.single_output, device)
    row = dict(system="transformers static cache, compiled", model=run.label, quantization="none",
               decode_tok_s=round(decode, 1))
    progress(f"{run.label}: transformers static-cache single stream {decode:.1f} tok/s")
    return row


# -- targets and the table ----------------------------------------------------------------

def find(rows: list[dict], system: str, model: str, key: str) -> float | None:
    for row in rows:
        if row.get("system") == system and row.get("model") == model and row.get(key) is not None:
            return row[key]
    return None


def targets(rows: list[dict], device: dict, kernels: list[dict] | None = None,
            spec: dict | None = None) -> list[tuple[str, str]]:
    """(verdict, text) per target of the GPU issue; ones not measured say so."""
    bf16, fp8, int4, small = "Llama-3-8B bf16", "Llama-3-8B fp8", "Llama-3-8B int4", "SmolLM2-135M bf16"
    ours = lambda model, key: find(rows, "pagedserve", model, key)  # noqa: E731
    peer_cb = find(rows, "transformers continuous batching", bf16, "offline_tok_s")
    served = next((r["served_tok_s"] for r in rows if r.get("model") == bf16 and "served_tok_s" in r), None)
    checks = [
        ("8B bf16 one stream >= 85% of the bandwidth roofline", ours(bf16, "roofline_share"), lambda v: v >= 0.85,
         lambda v: f"{v:.0%}"),
        ("fp8 one stream >= 1.6x bf16", ratio(ours(fp8, "decode_tok_s"), ours(bf16, "decode_tok_s")), lambda v: v >= 1.6,
         lambda v: f"{v:.2f}x"),
        ("int4 one stream >= 2.5x bf16", ratio(ours(int4, "decode_tok_s"), ours(bf16, "decode_tok_s")), lambda v: v >= 2.5,
         lambda v: f"{v:.2f}x"),
        ("8B bf16 offline >= 12,500 output tok/s", ours(bf16, "offline_tok_s"), lambda v: v >= 12500, lambda v: f"{v:,.0f}"),
        ("8B bf16 offline >= 2x transformers' continuous batching", ratio(ours(bf16, "offline_tok_s"), peer_cb),
         lambda v: v >= 2, lambda v: f"{v:.2f}x"),
        ("8B bf16 TTFT of 2,048 tokens <= 100 ms", ours(bf16, "ttft_2k_ms"), lambda v: v <= 100, lambda v: f"{v:.0f} ms"),
        ("bundled model one stream >= 1,000 tok/s", ours(small, "decode_tok_s"), lambda v: v >= 1000, lambda v: f"{v:,.0f}"),
        ("served at 64 gRPC streams >= 90% of offline", ratio(served, ours(bf16, "offline_at_served_tok_s")),
         lambda v: v >= 0.9, lambda v: f"{v:.0%}"),
        ("8B bf16 grammar mask at 32 streams <= 5% of a decode step", ours(bf16, "grammar_mask_share"),
         lambda v: v <= 0.05, lambda v: f"{v:+.1%}"),
        ("our fp8 and int4 GEMMs at M = 1-16 at least as fast as the vendor kernel beside them in the same run, "
         "on every 8B shape", slowest_vs_vendor(kernels), lambda v: v >= 1,
         lambda v: f"the slowest at {v:.2f}x the vendor's speed"),
        (f"8B bf16 verify of 4 drafts <= {SPEC_CEILING}x a one-token decode step at batch 1",
         spec.get("verify_over_plain") if spec and spec.get("shape") == "llama-3-8b" else None,
         lambda v: v <= SPEC_CEILING, lambda v: f"{v:.2f}x"),
    ]
    return [("NOT MEASURED", name) if value is None else
            ("PASS" if ok(value) else "FALLS SHORT", f"{name}: {show(value)}") for name, value, ok, show in checks]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def markdown(result: dict) -> str:
    device = result["device"]
    lines = [f"Device: {device['name']}; copy {device['copy_gb_s']:,} GB/s (read + write); bf16 matmul "
             f"{device['bf16_tflops']} TFLOP/s; torch {result['torch']}, transformers {result['transformers']}; "
             f"commit {result['commit']}; {result['seconds']:.0f} s.", "",
             "| system | model | engine | weights GB / step | single-stream decode tok/s | roofline tok/s | share of roofline "
             "| TTFT 2,048 tokens (ms) | offline tok/s (requests) | engine load (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    show = lambda v, f="{}": "-" if v is None else f.format(v)  # noqa: E731
    for row in (r for r in result["rows"] if "served_tok_s" not in r):
        offline = "-" if row.get("offline_tok_s") is None else f"{row['offline_tok_s']:,} ({row['offline_requests']})"
        engine = "-" if "compiled" not in row else ", ".join(
            name for name, on in (("compiled", row["compiled"]), ("decode graphs", row["decode_graphs"]),
                                  ("async", row["async_scheduling"])) if on) or "eager"
        lines.append(f"| {row['system']} | {row['model']} | {engine} | {show(row.get('weight_gb'))} | {show(row.get('decode_tok_s'))} "
                     f"| {show(row.get('roofline_tok_s'))} | {show(row.get('roofline_share'), '{:.0%}')} "
                     f"| {show(row.get('ttft_2k_ms'))} | {offline} | {show(row.get('load_s'))} |")
    for row in result["rows"]:
        if "served_tok_s" in row:
            offline = find(result["rows"], "pagedserve", row["model"], "offline_at_served_tok_s")
            lines += ["", f"{row['model']} served through tritonserver, {row['system'].split(', ')[1]}: "
                          f"{row['served_tok_s']:,} output tok/s over {row['served_requests']} requests (offline, same "
                          f"requests and concurrency: {show(offline, '{:,}')}); TTFT p50 {row['ttft_p50_ms']} ms, "
                          f"ITL p50 {row['itl_p50_ms']} ms."]
    if result.get("kernels"):
        lines += ["", kernel_markdown(result["kernels"])]
    if result.get("step_profile"):
        lines += ["", step_profile_markdown(result["step_profile"])]
    if result.get("spec"):
        lines += ["", spec_markdown(result["spec"])]
    if result.get("vision"):
        lines += ["", vision_markdown(result["vision"])]
    if result.get("moe"):
        lines += ["", moe_markdown(result["moe"])]
    if result.get("lora_mix") or result.get("lora_kernel"):
        lines += ["", lora_markdown(result.get("lora_mix"), result.get("lora_kernel"))]
    if result.get("deterministic"):
        lines += ["", deterministic_markdown(result["deterministic"])]
    lines += [""] + [f"- {verdict}: {text}" for verdict, text in result["targets"]]
    if result["skipped"]:
        lines += [""] + [f"- skipped: {text}" for text in result["skipped"]]
    return "\n".join(lines)


def progress(text: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {text}", flush=True)


def commit() -> str:
    import subprocess

    if os.environ.get("PAGEDSERVE_COMMIT"):  # a copy of the tree without its history (a lent GPU machine)
        return os.environ["PAGEDSERVE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PAGEDSERVE_COMMIT", "unknown")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and requests (at most ~4 minutes on a GPU)")
    parser.add_argument("--out", default=".", help="folder for gpu.json and gpu.md")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (sections that would not fit are skipped)")
    parser.add_argument("--models", default="", help="comma-separated labels to keep (default: all of the plan)")
    parser.add_argument("--skip-peer", action="store_true", help="leave transformers out")
    parser.add_argument("--skip-served", action="store_true", help="leave tritonserver out")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; use --device cpu for the dry run")
    if args.device == "cpu":  # the Triton kernels of the kernel table run through the interpreter (as the tests do);
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported, which nothing has done yet
    started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="[%(name)s %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    plan = make_plan(args.device, args.quick, args.budget)
    if args.models:
        keep = {m.strip() for m in args.models.split(",")}
        plan.runs = [r for r in plan.runs if r.label in keep]
    left = lambda: plan.budget_s - (time.perf_counter() - started)  # noqa: E731
    import transformers

    result: dict = dict(commit=commit(), torch=torch.__version__, transformers=transformers.__version__, rows=[], skipped=[])
    result["device"] = measure_device(args.device, plan)
    progress(f"device: {result['device']}")
    bandwidth = result["device"]["copy_gb_s"] * 1e9
    os.makedirs(args.out, exist_ok=True)

    def save() -> str:
        """The files as they stand (after every section: a run cut off still leaves its numbers)."""
        result["seconds"] = time.perf_counter() - started
        result["targets"] = targets(result["rows"], result["device"], result.get("kernels"), result.get("spec"))
        table = markdown(result)
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "gpu.md"), "w") as f:
            f.write(table + "\n")
        return table

    kernel_s = 60 if args.quick else 90  # the grid's cap: rows past it say they were not measured
    attempt(result, "kernels", left, kernel_s + 10, lambda: result.__setitem__("kernels", kernel_rows(
        args.device, result["device"]["copy_gb_s"], quick=args.quick, seconds=kernel_s, progress=progress)))
    release(args.device)
    save()
    moe_tokens = (1, 256) if args.quick else (1, 32, 256, 2048)
    attempt(result, "fused MoE kernel", left, 60,
            lambda: result.__setitem__("moe", moe_rows(args.device, result["device"]["copy_gb_s"], moe_tokens)))
    release(args.device)
    save()
    lora_tokens = (1, 256) if args.quick else (1, 32, 256, 2048)
    attempt(result, "LoRA kernel", left, 30,
            lambda: result.__setitem__("lora_kernel", lora_kernel_rows(args.device, lora_tokens)))
    release(args.device)
    with tempfile.TemporaryDirectory() as root:
        lora_shape = "smollm2-135m" if args.device == "cuda" else "tiny"
        attempt(result, "LoRA adapters mixed", left, 120, lambda: result.__setitem__("lora_mix", lora_mix_rows(
            write_model_dir(lora_shape, os.path.join(root, lora_shape)), args.device, load_format="dummy",
            out_len=32 if args.quick else 64, label=lora_shape)))
    release(args.device)
    save()
    with tempfile.TemporaryDirectory() as root:
        for run in plan.runs:
            directory = os.path.join(root, run.shape)
            if not os.path.exists(directory):
                write_model_dir(run.shape, directory)
            attempt(result, f"pagedserve {run.label}", left, 60,
                    lambda: result["rows"].append(run_pagedserve(run, directory, args.device, plan, left, bandwidth)))
            save()
        profiled = os.path.join(root, "llama-3-8b" if args.device == "cuda" else "tiny")  # the bf16 model's shape
        attempt(result, "step profile", left, 60, lambda: result.__setitem__("step_profile", step_profile_rows(
            profiled if os.path.exists(profiled) else write_model_dir(os.path.basename(profiled), profiled),
            args.device, progress=progress)))
        release(args.device)
        save()
        draft_shape = "llama-3.2-1b" if args.device == "cuda" else "tiny"  # a draft for the 8B (its vocabulary)
        attempt(result, "speculative steps", left, 90, lambda: result.__setitem__("spec", spec_rows(
            profiled if os.path.exists(profiled) else write_model_dir(os.path.basename(profiled), profiled), args.device,
            steps=32 if args.device == "cuda" else 8, tokens=128 if args.device == "cuda" else 32, progress=progress,
            draft_directory=write_model_dir(draft_shape, os.path.join(root, f"draft-{draft_shape}")))))
        release(args.device)
        save()
        vision_shape = "qwen2.5-vl-3b" if args.device == "cuda" else "tiny"  # drawn on the GPU, written once (7.5 GB)
        attempt(result, "vision", left, 90, lambda: result.__setitem__("vision", vision_rows(
            vision_checkpoint(Path(root) / f"vision-{vision_shape}", vision_shape, args.device), vision_shape, args.device,
            repeats=3 if args.device == "cuda" else 1)))
        release(args.device)
        save()
        for run in plan.runs:
            if run.served and not args.skip_served:
                attempt(result, f"served {run.label}", left, 90,
                        lambda: result["rows"].append(run_served(run, os.path.join(root, run.shape), args.device, plan, root)))
                save()
        for run in plan.runs:  # the peer after every pagedserve number is in
            if run.peer and not args.skip_peer:
                attempt_peer(result, run, os.path.join(root, run.shape), args.device, plan, left)
                save()
        shape = "smollm2-135m" if args.device == "cuda" else "tiny"  # last: no target rides on it
        streams, tokens = (64, 32 if args.quick else 64) if args.device == "cuda" else (4, 8)
        attempt(result, "deterministic", left, 75, lambda: result.__setitem__("deterministic", deterministic_rows(
            write_model_dir(shape, os.path.join(root, f"{shape}-deterministic")), args.device, "bfloat16", "dummy",
            streams=streams, tokens=tokens, rounds=2 if args.device == "cuda" else 1, label=shape)))
        release(args.device)
    print("\n" + save(), flush=True)
    return result


def attempt(result: dict, name: str, left: Callable[[], float], needs: float, action: Callable[[], None]) -> None:
    """Run one section if `needs` seconds are left; a failure is recorded, not raised."""
    if left() < needs:
        result["skipped"].append(f"{name} (time: {left():.0f} s left, needs ~{needs:.0f})")
        progress(f"skipped {name}: out of time")
        return
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the table must still be written
        traceback.print_exc()
        result["skipped"].append(f"{name} (failed: {type(error).__name__}: {str(error)[:200]})")


def attempt_peer(result: dict, run: ModelRun, directory: str, device: str, plan: Plan, left: Callable[[], float]) -> None:
    holder: dict = {}

    def build() -> None:
        holder["model"] = hf_model(directory, device)

    attempt(result, f"transformers {run.label}", left, 60, build)
    if "model" in holder:
        model = holder["model"]
        attempt(result, f"transformers continuous batching {run.label}", left, 60,
                lambda: result["rows"].append(run_peer_batching(model, run, device, plan)))
        attempt(result, f"transformers static-cache single stream {run.label}", left, 90,
                lambda: result["rows"].append(run_peer_single(model, run, device, plan)))
    holder.clear()
    release(device)


if __name__ == "__main__":
    main()
