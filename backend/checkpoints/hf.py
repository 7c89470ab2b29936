"""Hugging Face model directories: config.json (+ generation_config.json) into a
ModelConfig, and the tensors of the safetensors files (sharded or not)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

import torch

from ..errors import ConfigError
from ..model_config import ModelConfig
from ..multimodal.vlm_config import VLM_ARCHITECTURES, is_vision_language, language_model_config, language_model_tensors
from . import Checkpoint
from .generation_config import eos_token_ids, generation_defaults, read_generation_config
from .gpt_oss import gpt_oss_fields, gpt_oss_tensors
from .quantization_config import checkpoint_quantization, prequantized

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
}

FUSED_IN_CHECKPOINT = {"phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}}
"""Projections a family's checkpoints store already stacked (Phi-3: q/k/v and gate/up), read as
their parts (`_split_fused`), so that loading, tensor-parallel sharding and quantization see
every family's checkpoint alike."""


def checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors files, under the checkpoint's own names."""
    return _safetensors_tensors(_safetensors_files(path))


def read_hf_checkpoint(path: str) -> Checkpoint:
    config = hf_dir_config(path)
    files = _safetensors_files(path)
    tensors, count = _safetensors_tensors(files), _count_safetensors(files)
    if config.vision_language:  # the language model's tensors; the vision encoder reads its own
        tensors = language_model_tensors(tensors)
    if config.architecture == "mixtral":
        tensors = _mixtral_names(tensors)
    if config.architecture == "gpt_oss":
        tensors = gpt_oss_tensors(tensors)
    fused = FUSED_IN_CHECKPOINT.get(config.architecture)
    if fused:
        tensors = _split_fused(tensors, fused, config)
        count += config.num_layers * sum(len(parts) - 1 for parts in fused.values())
    return Checkpoint(config, tensors, count)


MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
"""Mixtral's checkpoint names for its router and experts -> Qwen3-MoE's, the one naming the loader reads."""


def _mixtral_names(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        if ".block_sparse_moe." in name:
            for old, new in MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        yield name, tensor


def _split_fused(tensors: Iterator[tuple[str, torch.Tensor]], fused: dict[str, tuple[str, ...]],
                 config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Each stacked projection's weight (and bias) as its parts, named as Llama's checkpoints name
    them: q, k, v rows of q_size, kv_size, kv_size; gate and up halves."""
    for name, tensor in tensors:
        module, _, kind = name.rpartition(".")
        prefix, _, projection = module.partition(".layers.")
        layer, _, local = projection.partition(".")
        parts = fused.get(local)
        if parts is None:
            yield name, tensor
            continue
        sizes = ([config.q_size, config.kv_size, config.kv_size] if len(parts) == 3
                 else [tensor.shape[0] // len(parts)] * len(parts))
        if sum(sizes) != tensor.shape[0]:
            raise ConfigError("model", f"tensor {name} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                                       f"({' + '.join(map(str, sizes))})")
        for part, rows in zip(parts, tensor.split(sizes)):
            yield f"{prefix}.layers.{layer}.{part}.{kind}", rows


def hf_dir_config(path: str) -> ModelConfig:
    """The ModelConfig of a model directory (its config.json and generation_config.json)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ConfigError("model", f"{path!r} has no config.json; is it a Hugging Face model directory?")
    with open(config_path) as f:
        config = json.load(f)
    generation = read_generation_config(path)
    quantization = checkpoint_quantization(path, config)
    if quantization:
        config["quantization_config"] = quantization
    return hf_model_config(config, generation)


def hf_model_config(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig of parsed config.json (and generation_config.json) contents; a vision-language
    model's is its language model's (backend/multimodal/vlm_config.py)."""
    if is_vision_language(config):
        try:
            text = language_model_config(config)
        except ValueError as error:
            raise ConfigError("model", str(error)) from None
        return dataclasses.replace(hf_model_config(text, generation_config),
                                   vision_language=VLM_ARCHITECTURES[config["architectures"][0]])
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            "model",
            f"architecture {arch} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)} and, with images, "
            f"{sorted(VLM_ARCHITECTURES)}",
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    gemma = _gemma(config, rope, family) if family in ("gemma2", "gemma3") else {}
    if gemma:
        rope = gemma.pop("global_rope")
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if config.get("mlp_bias"):  # the MLP's linears have no bias here: they would be dropped silently
        raise ConfigError("model", f"{arch} with MLP biases (mlp_bias) is not supported")
    if family in FUSED_IN_CHECKPOINT and config.get("quantization_config"):
        raise ConfigError("model", f"{arch} checkpoints with packed 4-bit weights are not supported (their "
                                   "q/k/v and gate/up are stacked); load the bf16 checkpoint with quantization "
                                   "int4 or fp8 instead")
    context = config.get("max_position_embeddings", 4096)
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if family == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's early names for LongRoPE (as transformers reads them)
        rope_type, rope = "longrope", {key: value for key, value in rope.items() if key != "type"} | {"rope_type": "longrope"}
    if rope_type == "longrope":
        rope, context = _longrope(config, rope, context)
    return ModelConfig(
        architecture=family,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=context,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", family in ("gemma2", "gemma3"))),  # Gemma's: tied
        qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        o_bias=bool(config.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "olmo2", "gemma3"),
        qk_norm_across_heads=family == "olmo2",
        sublayer_output_norms=family == "olmo2",
        norm_rounds_once=family in ("olmo2", "gemma2", "gemma3", "gpt_oss"),
        **(_granite_multipliers(config) if family == "granite" else {}),
        **gemma,
        rope_scaling=dict(rope) if rope_type not in ("default", "mrope", None) else None,
        mrope_section=tuple(int(n) for n in rope["mrope_section"]) if rope.get("mrope_section") else None,
        partial_rotary_factor=partial,
        **_sliding_window(config, family),
        **(gpt_oss_fields(config) if family == "gpt_oss" else _experts(config, family)),
        eos_token_ids=eos_token_ids(config, generation_config),
        generation_defaults=generation_defaults(generation_config or {}),
        bos_token_id=config.get("bos_token_id"),
        checkpoint_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        **prequantized(config.get("quantization_config") if family != "gpt_oss" else None),  # its MXFP4: gpt_oss.py
    )


def _longrope(config: dict[str, Any], rope: dict[str, Any], context: int) -> tuple[dict[str, Any], int]:
    """LongRoPE's parameters with its factor and original context settled (transformers': the
    config's factor, else max_position_embeddings over the original), and the context the engine
    serves: the original one, within which the short factors are exact (models/rope.py,
    _longrope_frequencies)."""
    original = int(rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or context)
    factor = float(rope.get("factor") or context / original)
    return {**rope, "original_max_position_embeddings": original, "factor": factor}, min(context, original)


def _gemma(config: dict[str, Any], rope: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma 2's and 3's variations of the Llama layer (ModelConfig's fields), and the rope parameters
    of their full-attention layers ("global_rope"; Gemma 3's sliding-window layers have their own
    base), from config.json as transformers 4 or 5 writes it."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError("model", f"hidden_activation {config['hidden_activation']!r} is not supported (gelu_pytorch_tanh is)")
    if config.get("use_bidirectional_attention"):
        raise ConfigError("model", "bidirectional attention (use_bidirectional_attention) is not supported")
    nested = "full_attention" in rope or "sliding_attention" in rope  # transformers 5: per layer type
    global_rope = dict(rope.get("full_attention") or {}) if nested else dict(rope)
    local_rope = dict(rope.get("sliding_attention") or {}) if nested else {}
    global_rope.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0 if family == "gemma3" else 10_000.0))
    if local_rope.get("rope_type", "default") != "default":
        raise ConfigError("model", f"rope scaling on Gemma 3's sliding-window layers ({local_rope}) is not supported")
    local_theta = local_rope.get("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return dict(
        global_rope=global_rope,
        sandwich_norms=True, norm_weight_offset=1.0, activation="gelu_tanh",
        local_rope_theta=float(local_theta) if family == "gemma3" else None,
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        embedding_multiplier=float(config["hidden_size"]) ** 0.5, embedding_multiplier_rounds=True,
        attention_multiplier=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
    )


def _sliding_window(config: dict[str, Any], family: str) -> dict[str, Any]:
    """sliding_window and the layers that attend within it, as transformers runs them: every
    layer of Mistral (which ignores a layer_types list); Qwen2 / Qwen3 only with use_sliding_window,
    from max_window_layers on; Gemma 2 / 3 and others by layer_types, or Gemma's pattern (every
    sliding_window_pattern-th layer global: 2 in Gemma 2, 6 in Gemma 3)."""
    window = config.get("sliding_window")
    qwen = family in ("qwen2", "qwen3", "qwen3_moe")
    if qwen and not config.get("use_sliding_window", False):
        window = None
    if not window:
        return {}
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if family in ("mistral", "mixtral") or (types is None and not qwen and family not in ("gemma2", "gemma3")):
        types = ["sliding_attention"] * layers
    elif types is None and family in ("gemma2", "gemma3"):
        pattern = config.get("sliding_window_pattern", 6 if family == "gemma3" else 2)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif types is None:
        first = config.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return dict(sliding_window=int(window), sliding_layers=tuple(i for i, kind in enumerate(types)
                                                                 if kind == "sliding_attention"))


def _experts(config: dict[str, Any], family: str) -> dict[str, Any]:
    """A mixture of experts' numbers (ModelConfig's fields), as transformers reads them."""
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    if family == "mixtral":
        return dict(num_experts=config.get("num_local_experts", 8), experts_per_token=config.get("num_experts_per_tok", 2),
                    expert_intermediate_size=config["intermediate_size"],
                    moe_layers=tuple(range(config["num_hidden_layers"])))
    experts = config.get("num_experts", config.get("num_local_experts", 128))  # transformers 5 writes the latter
    step = config.get("decoder_sparse_step", 1)
    skipped = set(config.get("mlp_only_layers") or ())
    return dict(num_experts=experts, experts_per_token=config.get("num_experts_per_tok", 8),
                expert_intermediate_size=config.get("moe_intermediate_size", 768),
                moe_layers=tuple(i for i in range(config["num_hidden_layers"])
                                 if experts > 0 and i not in skipped and (i + 1) % step == 0),
                renormalize_expert_weights=bool(config.get("norm_topk_prob", False)), expert_weights_rounded=True)


def _granite_multipliers(config: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars, with transformers' GraniteConfig defaults (1.0 each: its attention
    multiplier too, not 1/sqrt(head_dim))."""
    names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {name: float(config.get(name, 1.0)) for name in names}


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError("model", f"{path!r} has no *.safetensors weights")
    return [os.path.join(path, f) for f in files]


def _count_safetensors(files: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    return total


def _safetensors_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
