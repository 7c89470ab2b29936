"""LoRA adapters as PEFT saves them, and the list of adapters a model serves.

An adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, the target modules)
and `adapter_model.safetensors` (per target, `...layers.<i>.<module>.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]). What pagedserve cannot run as PEFT would (DoRA, trained biases or
whole modules saved beside the adapter, per-module ranks, embedding or head targets) is refused
at load, naming the adapter and the key, never run differently.

The list (`lora_modules`) is Triton's vLLM backend's multi_lora.json, `{"name": "folder", ...}`,
or `name=folder,name=folder` on the command line.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

MULTI_LORA_FILE = "multi_lora.json"
"""The adapters' list in a Triton model's version folder (Triton's vLLM backend's name)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_NEUTRAL: dict[str, tuple[object, ...]] = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
            "fan_in_fan_out": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "use_qalora": (False, None), "lora_bias": (False, None)}
"""adapter_config.json keys pagedserve serves at these values only (PEFT's defaults)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host, keyed by (layer, checkpoint module) as PEFT names them."""

    name: str
    path: str
    scaling: float
    """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA: what PEFT multiplies the delta by."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """(layer index, module such as "self_attn.q_proj") -> (A [r, in], B [out, r])."""


def read_lora_modules(spec: str) -> dict[str, str]:
    """name -> adapter folder from `lora_modules`: a multi_lora.json path or `name=folder,...`.
    A relative folder in a JSON file is read beside the file."""
    if not spec:
        return {}
    if "=" not in spec:
        try:
            with open(spec) as f:
                listed = json.load(f)
        except (OSError, ValueError) as error:
            raise ConfigError("lora_modules", f"cannot read {spec} as a JSON object of adapter name -> folder "
                                              f"({error})") from None
        if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
            raise ConfigError("lora_modules", f"{spec} must hold a JSON object of adapter name -> folder")
        here = os.path.dirname(os.path.abspath(spec))
        return {str(name): folder if os.path.isabs(folder) else os.path.join(here, folder)
                for name, folder in listed.items()}
    modules = {}
    for item in spec.split(","):
        name, sep, folder = item.partition("=")
        if not sep or not name.strip() or not folder.strip():
            raise ConfigError("lora_modules", f"{item!r} is not name=folder (give name=folder,name=folder or a "
                                              f"{MULTI_LORA_FILE} path)")
        modules[name.strip()] = folder.strip()
    return modules


def load_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """Read one PEFT adapter (ConfigError naming the adapter for anything it cannot serve)."""
    def refuse(message: str) -> ConfigError:
        return ConfigError("lora_modules", f"adapter {name!r} ({path}): {message}")

    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise refuse(f"cannot read its {ADAPTER_CONFIG} ({error}); save it with peft's save_pretrained") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, neutral in _NEUTRAL.items():
        if key in config and config[key] not in neutral:
            raise refuse(f"{key}={config[key]!r} is not supported (served: {neutral[0]!r})")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if not 1 <= rank <= max_rank:
        raise refuse(f"rank {rank} is above max_lora_rank {max_rank}; raise max_lora_rank")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.exists(weights_path):
        raise refuse(f"has no {ADAPTER_WEIGHTS} (pagedserve reads safetensors; save with safe_serialization)")
    from safetensors.torch import load_file

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        match = _KEY.search(key)
        if match is None:
            raise refuse(f"tensor {key!r} is not a decoder layer's lora_A / lora_B (embedding, head and saved "
                         "modules are not served)")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise refuse(f"layer {layer}'s {module} has lora_{''.join(pair)} alone")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise refuse(f"layer {layer}'s {module} has rank {a.shape[0]}, its config says r={rank}")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise refuse("holds no LoRA weights")
    return LoRAAdapter(name, path, scaling, weights)


__all__ = ["LoRAAdapter", "MULTI_LORA_FILE", "load_adapter", "read_lora_modules"]
