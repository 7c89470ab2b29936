"""Materialize the model repository for a given model and engine settings.

The committed `model_repository/` holds defaults. Serving another model (or
tests with a small KV budget) writes a copy whose config.pbtxt `parameters`
carry the chosen values. The model is named once, in the config.pbtxt of `llm`
(which hosts the engine); the models that load a tokenizer read it from there.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Mapping

from pagedserve.backend.config import EngineConfig
from pagedserve.backend.errors import ConfigError
from pagedserve.backend.triton_adapter.arguments import ENGINE_MODEL, ENGINE_SWITCHES

ENGINE_ONLY_PARAMETERS = set(ENGINE_SWITCHES)


def source_repository() -> Path:
    """The repository shipped with the project (a checkout or the Docker image)."""
    here = Path(__file__).resolve().parent.parent / "model_repository"
    override = os.environ.get("PAGEDSERVE_MODEL_REPOSITORY")
    path = Path(override) if override else here
    if not (path / ENGINE_MODEL / "config.pbtxt").exists():
        raise FileNotFoundError(
            f"no model repository at {path}; set PAGEDSERVE_MODEL_REPOSITORY to the project's model_repository/"
        )
    return path


def write_repository(destination: str | os.PathLike, model: str = "", engine: Mapping[str, object] | None = None) -> Path:
    """Copy the repository to destination with `model` and engine parameters set.

    Engine settings are checked against EngineConfig first, so a typo fails here
    with the field named rather than at model load inside the server.
    """
    strings = {k: str(v) for k, v in (engine or {}).items()}
    EngineConfig.from_strings({k: v for k, v in strings.items() if k not in ENGINE_ONLY_PARAMETERS} | {"model": model})
    destination = Path(destination)
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source_repository(), destination, ignore=shutil.ignore_patterns("__pycache__"))
    set_parameters(destination / ENGINE_MODEL / "config.pbtxt", {"model": model, **strings})
    return destination


_PARAMETER = 'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def set_parameters(config_path: Path, values: Mapping[str, str]) -> None:
    """Set (or add) string parameters in a config.pbtxt."""
    text = config_path.read_text()
    for key, value in values.items():
        if '"' in value or "\n" in value:
            raise ConfigError(key, "must not contain quotes or newlines")
        line = _PARAMETER.format(key=key, value=value)
        pattern = re.compile(r'parameters \{ key: "' + re.escape(key) + r'" value: \{ string_value: "[^"]*" \} \}')
        text, count = pattern.subn(line.replace("\\", "\\\\"), text)
        if count == 0:
            text = text.rstrip("\n") + "\n" + line + "\n"
    config_path.write_text(text)
