"""Vision-language checkpoints seen from the text engine: their language model's config.json
section and tensor names, so that everything text models have (paged KV, kernels, quantization,
LoRA) loads it unchanged; the vision part is the encoder's (encoder.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator

from ..model_files import read_model_json

if TYPE_CHECKING:
    import torch

VLM_ARCHITECTURES = {
    "LlavaForConditionalGeneration": "llava",
    "LlavaNextForConditionalGeneration": "llava_next",
    "LlavaOnevisionForConditionalGeneration": "llava_onevision",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Gemma3ForConditionalGeneration": "gemma3",
}
"""Supported vision-language architectures (config.json `architectures[0]`) -> their family."""

BIDIRECTIONAL_IMAGES = {"gemma3"}
"""Families whose image tokens attend to one another (the rest of the prompt is causal)."""

TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                      "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_vl": "Qwen2ForCausalLM",
                      "gemma3_text": "Gemma3ForCausalLM"}
"""The language model inside, by its text_config model_type -> the text architecture that loads it."""

_LM_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
"""Checkpoint names of the language model (transformers 4's and 5's layouts) -> a text model's."""
_VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "model.image_newline",
                    "visual.", "vision_tower.", "multi_modal_projector.", "image_newline")


def language_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model when it is the language model's, else None (the
    vision tower's or the projector's). Qwen2.5-VL's checkpoints keep a text model's own names."""
    for prefix, ours in _LM_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    if name.startswith("model.") and not name.startswith(_VISION_PREFIXES):
        return name
    return None


def is_vision_language(config: dict[str, Any]) -> bool:
    """Whether a parsed config.json is a vision-language model's."""
    archs = config.get("architectures") or []
    return bool(archs) and archs[0] in VLM_ARCHITECTURES


def takes_images(model_path: str) -> bool:
    """Whether the model at `model_path` (a Hugging Face directory) is a vision-language model."""
    config = read_model_json(model_path, "config.json") if os.path.isdir(model_path) else None
    return config is not None and is_vision_language(config)


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json as a text model's: its text_config, with the architecture
    that loads it; ValueError naming the model type where none does."""
    text = dict(config.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(f"{config['architectures'][0]} with a {model_type!r} language model is not supported; "
                         f"supported: {sorted(TEXT_ARCHITECTURES)}")
    text["architectures"] = [TEXT_ARCHITECTURES[model_type]]
    for key in ("torch_dtype", "dtype"):
        text.setdefault(key, config.get(key))
    if "tie_word_embeddings" in config:
        text.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    return text


def language_model_tensors(tensors: Iterator[tuple[str, "torch.Tensor"]]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The language model's tensors under a text model's names; the vision tower's and projector's
    are left out (the encoder reads them)."""
    for name, tensor in tensors:
        ours = language_model_name(name)
        if ours is not None:
            yield ours, tensor
