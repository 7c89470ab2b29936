"""generation_config.json: the facts a checkpoint gives about generating beside its architecture, read
as vLLM reads them: the EOS ids (joined with config.json's) and the sampling values its makers
recommend (what requests that set none get: ModelConfig.generation_defaults)."""

from __future__ import annotations

from typing import Any

from ..model_files import read_model_json

GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}
"""The sampling fields a generation_config.json may set, with transformers' GenerationConfig defaults."""


def read_generation_config(path: str) -> dict[str, Any] | None:
    """A model directory's generation_config.json, None where it has none."""
    return read_model_json(path, "generation_config.json")


def eos_token_ids(config: dict[str, Any], generation: dict[str, Any] | None) -> list[int]:
    """config.json's EOS id(s), then generation_config.json's, each once."""
    ids: list[int] = []
    for source in (config, generation or {}):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields `generation_config` sets to other than transformers' defaults, as vLLM reads
    them (`to_diff_dict`): Llama 3.1's {"temperature": 0.6, "top_p": 0.9}; a top_k of 50 is
    transformers' default, so it is not taken."""
    return {key: generation_config[key] for key, default in GENERATION_DEFAULTS.items()
            if generation_config.get(key) is not None and generation_config[key] != default}
