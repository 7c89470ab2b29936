"""What serving LoRA adapters costs, side by side in one run.

1. The engine (`mix_rows`): 32 streams in flight (random-token prompts of 128 tokens, 64 output tokens
   forced with ignore_eos, greedy) through the base model with LoRA off, the same with LoRA on and every
   request on the base model, every request on one adapter, and 4 adapters mixed (8 streams each):
   output tok/s and the ratio to LoRA off. Adapters of rank 16 on all seven projections, random weights
   written in PEFT's layout for the model being served (nothing is downloaded).
2. The kernel (`kernel_rows`): one layer's batched delta, torch reference (two matmuls per adapter in
   the step: the CPU path) and the grouped Triton kernels (CUDA), beside the base layer's own matmul,
   for Llama-3-8B's qkv_proj and down_proj with 4 adapters mixed. A section of benchmarks/gpu.py.

    python benchmarks/lora.py [--device cpu|cuda] [--model DIR] [--streams 32]

On CPU the engine runs the bundled model and the kernel rows a tiny shape (the dry run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_kernel import _time  # noqa: E402
from workload import machine  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402
from pagedserve.backend.model_config import ModelConfig  # noqa: E402
from pagedserve.kernels.lora import add_lora_ref  # noqa: E402

RANK = 16
ADAPTERS = 4


def write_random_adapter(folder: str, config: ModelConfig, seed: int, rank: int = RANK) -> str:
    """A PEFT adapter (adapter_config.json, adapter_model.safetensors) of `rank` on every projection of
    every layer of a model shaped as `config`, random weights (B too: the delta is not zero)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (config.q_size, config.hidden_size), "self_attn.k_proj": (config.kv_size, config.hidden_size),
              "self_attn.v_proj": (config.kv_size, config.hidden_size), "self_attn.o_proj": (config.hidden_size, config.q_size),
              "mlp.gate_proj": (config.intermediate_size, config.hidden_size),
              "mlp.up_proj": (config.intermediate_size, config.hidden_size),
              "mlp.down_proj": (config.hidden_size, config.intermediate_size)}
    tensors = {}
    for layer in range(config.num_layers):
        for module, (rows, columns) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, columns, generator=g) * columns ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": sorted({m.split(".")[1] for m in shapes})}, f)
    return folder


def _throughput(engine: LLMEngine, prompts: list[list[int]], names: list[str | None], out_len: int) -> float:
    params = [SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True, lora_name=name) for name in names]
    engine.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: kernels built, adapters read
    start = time.perf_counter()
    results = engine.generate(prompts, params, use_tqdm=False)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


def mix_rows(model: str, device: str, streams: int = 32, prompt_len: int = 128, out_len: int = 64,
             load_format: str = "auto", label: str = "") -> list[dict]:
    """One row per run (see the module docstring); `label` names the model in the table."""
    settings = dict(model=model, device=device, load_format=load_format, max_num_seqs=streams)
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        engine = LLMEngine(**settings)
        vocab = engine.model_config.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(streams)]
        rows.append(dict(run="LoRA off, base model", tok_s=_throughput(engine, prompts, [None] * streams, out_len)))
        modules = ",".join(f"a{i}={write_random_adapter(os.path.join(root, f'a{i}'), engine.model_config, i)}"
                           for i in range(ADAPTERS))
        del engine
        gc.collect()
        engine = LLMEngine(**settings, enable_lora=True, lora_modules=modules, max_loras=ADAPTERS)
        for run, names in (("LoRA on, base model", [None] * streams), ("LoRA on, one adapter", ["a0"] * streams),
                           (f"LoRA on, {ADAPTERS} adapters mixed", [f"a{i % ADAPTERS}" for i in range(streams)])):
            rows.append(dict(run=run, tok_s=_throughput(engine, prompts, names, out_len)))
        del engine
        gc.collect()
    for row in rows:
        row["tok_s"] = round(row["tok_s"], 1)
        row["vs_lora_off"] = round(row["tok_s"] / rows[0]["tok_s"], 3)
        row["model"] = label or os.path.basename(model.rstrip("/")) or "bundled"
    return rows


def kernel_rows(device: str, tokens: tuple[int, ...] = (1, 32, 256, 2048)) -> list[dict]:
    """One row per (layer, token count): the delta's time by each implementation and the base matmul's."""
    layers = ({"Llama-3-8B qkv_proj": (4096, 6144, 3), "Llama-3-8B down_proj": (14336, 4096, 1)} if device == "cuda"
              else {"tiny qkv_proj": (64, 128, 3)})
    fused = None
    if device == "cuda":
        from pagedserve.kernels.triton.lora import add_lora_triton as fused
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, (width_in, width_out, projections) in layers.items():
        rank = RANK * projections
        weight = torch.randn(width_out, width_in, device=device, dtype=dtype, generator=g) * width_in ** -0.5
        a = torch.randn(ADAPTERS, rank, width_in, device=device, dtype=dtype, generator=g) * width_in ** -0.5
        b = torch.randn(ADAPTERS, width_out, rank, device=device, dtype=dtype, generator=g) * 0.01
        scaling = torch.full((ADAPTERS,), 2.0, device=device)
        for count in tokens if device == "cuda" else tokens[:2]:
            x = torch.randn(count, width_in, device=device, dtype=dtype, generator=g)
            out = x @ weight.t()
            slots = torch.arange(count, device=device, dtype=torch.int32) % ADAPTERS
            repeats = 10 if device == "cuda" else 2
            row = dict(layer=name, tokens=count, base_ms=round(_time(lambda: x @ weight.t(), device, repeats), 3),
                       ref_ms=round(_time(lambda: add_lora_ref(out, x, a, b, scaling, slots), device, repeats), 3),
                       fused_ms=None)
            if fused is not None:
                row["fused_ms"] = round(_time(lambda: fused(out, x, a, b, scaling, slots), device, repeats), 3)
            rows.append(row)
    return rows


def markdown(mix: list[dict] | None, kernels: list[dict] | None) -> str:
    lines = []
    if mix:
        lines += ["| model | run (32 streams) | output tok/s | vs LoRA off |", "|---|---|---:|---:|"]
        lines += [f"| {r['model']} | {r['run']} | {r['tok_s']:,} | {r['vs_lora_off']:.2f}x |" for r in mix]
    if kernels:
        show = lambda v: "-" if v is None else v  # noqa: E731
        lines += ["", f"| LoRA delta, {ADAPTERS} adapters mixed, rank {RANK} a projection (bf16) | tokens | base matmul (ms) "
                      "| torch reference (ms) | grouped Triton (ms) |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['layer']} | {r['tokens']} | {r['base_ms']} | {r['ref_ms']} | {show(r['fused_ms'])} |" for r in kernels]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="", help="model directory (default: the bundled model)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    print(machine())
    mix = mix_rows(args.model, args.device, args.streams)
    kernels = None if args.skip_kernels else kernel_rows(args.device)
    print(markdown(mix, kernels))
