"""The served model is named once, in the engine model's config.pbtxt."""

from __future__ import annotations

import json

import pytest

from pagedserve.backend.errors import ConfigError
from pagedserve.backend.triton_adapter.arguments import pbtxt_parameters, served_model


def args_for(repository, name, parameters=None):
    config = {"parameters": {k: {"string_value": v} for k, v in (parameters or {}).items()}}
    return {"model_repository": str(repository / name), "model_name": name, "model_config": json.dumps(config)}


@pytest.fixture
def repository(tmp_path):
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.pbtxt").write_text(
        'name: "llm"\nparameters { key: "model" value: { string_value: "/models/x" } }\n'
        'parameters { key: "dtype" value: { string_value: "auto" } }\n'
    )
    (tmp_path / "my_engine").mkdir()
    (tmp_path / "my_engine" / "config.pbtxt").write_text('parameters {\n  key: "model"\n  value: { string_value: "/models/y" }\n}\n')
    return tmp_path


def test_tokenizer_models_learn_the_model_from_the_engine_config(repository):
    assert served_model(args_for(repository, "llm_engine")) == "/models/x"
    assert served_model(args_for(repository, "postprocessing", {"engine_model": "my_engine"})) == "/models/y"
    assert served_model(args_for(repository, "preprocessing", {"model": "/models/x"})) == "/models/x"  # agreeing is fine


def test_a_disagreeing_model_parameter_fails_naming_the_one_place(repository):
    with pytest.raises(ConfigError, match="set `model` only in llm/config.pbtxt"):
        served_model(args_for(repository, "preprocessing", {"model": "/models/other"}))


def test_a_missing_engine_config_names_the_parameter_to_fix(repository):
    with pytest.raises(ConfigError, match="engine_model"):
        served_model(args_for(repository, "llm_engine", {"engine_model": "nowhere"}))


def test_pbtxt_parameters_reads_string_parameters():
    text = 'parameters { key: "a" value: { string_value: "1" } }\nparameters { key: "b" value: { string_value: "" } }'
    assert pbtxt_parameters(text) == {"a": "1", "b": ""}
