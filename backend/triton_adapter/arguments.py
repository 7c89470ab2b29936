"""What a model's initialize args configure: config.pbtxt `parameters`, and the
tokenizer of the served model.

Which model is served is said in one place, the `model` parameter of the engine's
model's config.pbtxt (`llm`); the relays, `preprocessing` and `postprocessing` read
it from there (their `engine_model` parameter names the engine's model when it is
not `llm`), so a tokenizer can never disagree with the engine's weights.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

from ..errors import ConfigError
from ..model_files import resolve_model_path
from ..tokenizer import load_tokenizer

ENGINE_MODEL = "llm"
"""The model that hosts the engine; the relays send it token ids over BLS."""
ENGINE_SWITCHES = ("REPORT_CUSTOM_METRICS", "enable_metrics")
"""Switches of the engine model's config.pbtxt; set on another model they would do nothing."""
_PBTXT_PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain name -> string dict."""
    config = json.loads(args["model_config"])
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def pbtxt_parameters(text: str) -> dict[str, str]:
    """The string `parameters` of a config.pbtxt's text (the form our repository uses)."""
    return dict(_PBTXT_PARAMETER.findall(text))


def served_model(args: Mapping[str, str]) -> str:
    """The `model` parameter of the engine model's config.pbtxt, beside this model's
    directory in the same repository ('' means the bundled default model)."""
    engine_model = model_parameters(args).get("engine_model") or ENGINE_MODEL
    config_path = os.path.join(os.path.dirname(os.path.normpath(args["model_repository"])), engine_model, "config.pbtxt")
    try:
        with open(config_path) as f:
            served = pbtxt_parameters(f.read()).get("model", "")
    except OSError as error:
        raise ConfigError(
            "engine_model", f"cannot read {config_path} ({error.strerror}); the served model is set there"
        ) from None
    misplaced = sorted(set(model_parameters(args)) & set(ENGINE_SWITCHES))
    if misplaced:
        raise ConfigError(
            misplaced[0], f"is a switch of {engine_model}; set it in {engine_model}/config.pbtxt, not in "
            f"{args.get('model_name', 'this model')}'s"
        )
    own = model_parameters(args).get("model")
    if own and own != served:
        raise ConfigError(
            "model",
            f"{args.get('model_name', 'this model')} says {own!r} but {engine_model} serves {served!r}; "
            f"set `model` only in {engine_model}/config.pbtxt",
        )
    return served


def tokenizer_from_args(args: Mapping[str, str]) -> Any:
    """The served model's tokenizer (the bundled default model's when none is named)."""
    return load_tokenizer(resolve_model_path(served_model(args)))
