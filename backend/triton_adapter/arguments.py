"""What a model's initialize args configure: config.pbtxt `parameters`, and the
tokenizer of the model they name."""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..model_files import resolve_model_path
from ..tokenizer import load_tokenizer


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain name -> string dict."""
    config = json.loads(args["model_config"])
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def tokenizer_from_args(args: Mapping[str, str]) -> Any:
    """The tokenizer of the `model` parameter (the bundled default model when empty)."""
    return load_tokenizer(resolve_model_path(model_parameters(args).get("model", "")))
