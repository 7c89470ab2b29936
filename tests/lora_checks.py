"""Shared by the LoRA tests (tests/test_lora.py, tests/integration/test_lora_served.py, the speculative
decoding tests): PEFT adapters made on a small random Llama, the greedy tokens transformers + peft give
with them, and a batch of two adapters' requests beside a base one."""

from __future__ import annotations

import json
import os

import torch

ADAPTERS = {  # name -> LoraConfig settings (B random too, so every adapter changes the answers)
    "every-projection": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj"]),
    "q-and-v": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp-rslora": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def write_adapters(model_dir: str, folder: str | os.PathLike) -> tuple[str, dict]:
    """ADAPTERS made with peft on `model_dir` and saved under `folder`, with a multi_lora.json listing
    them by relative folder: (its path, name -> the transformers + peft model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    references = {}
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **settings)).eval()
        model.save_pretrained(os.path.join(folder, name))
        references[name] = model
    listing = os.path.join(folder, "multi_lora.json")
    with open(listing, "w") as f:
        json.dump({name: name for name in ADAPTERS}, f)
    return listing, references


def greedy(reference, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens (exactly max_tokens)."""
    with torch.inference_mode():
        out = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def mixed_adapter_batch(model_dir: str, folder: str | os.PathLike) -> tuple[dict, list[list[int]], list]:
    """Engine settings serving two of ADAPTERS made on `model_dir` (under `folder`), and three greedy
    20-token requests: one of each adapter and a base one (its prompt the first's)."""
    from pagedserve.backend import SamplingParams

    write_adapters(model_dir, folder)
    modules = ",".join(f"{name}={os.path.join(folder, name)}" for name in ("q-and-v", "every-projection"))
    settings = dict(model=model_dir, dtype="float32", enable_lora=True, lora_modules=modules)
    prompts = [list(range(40, 52)), list(range(60, 75)), list(range(40, 52))]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, lora_name=name)
              for name in ("q-and-v", "every-projection", None)]
    return settings, prompts, params
