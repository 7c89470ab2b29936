"""Structured outputs through the served contracts: `llm` takes vLLM's keys in
`sampling_parameters`, the TensorRT-LLM models `guided_decoding_guide_type` /
`guided_decoding_guide`; what comes back parses and validates; a schema that does not
compile is refused naming it, and the server serves on."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .conftest import llm_inputs, stream_request, texts
from .test_trtllm_contract import trt_text

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("key", ["structured_outputs", "guided_json"])
def test_llm_returns_json_that_validates(server, key):
    value = {"json": SCHEMA} if key == "structured_outputs" else SCHEMA
    for seed in range(3):
        results, error = stream_request(server, llm_inputs("A person as JSON:", max_tokens=120, temperature=1.0,
                                                           seed=seed, **{key: value}))
        assert error is None, error
        jsonschema.validate(json.loads("".join(texts(results))), SCHEMA)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_tensorrt_llm_guided_decoding_inputs(server, model):
    text = "".join(trt_text(server, model, "A person as JSON:", 120, top_k=40, top_p=0.9, seed=1, exclude_input_in_output=True,
                            guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(SCHEMA)))
    jsonschema.validate(json.loads(text), SCHEMA)
    regex = "".join(trt_text(server, model, "A code:", 20, guided_decoding_guide_type="regex", exclude_input_in_output=True,
                             guided_decoding_guide="[A-Z]{2}[0-9]{2}"))
    assert len(regex) == 4 and regex[:2].isupper() and regex[2:].isdigit(), regex


def test_a_schema_that_does_not_compile_is_refused_by_name_and_the_server_serves_on(server):
    _, error = stream_request(server, llm_inputs("Hi", max_tokens=8, guided_json={"type": "no-such-type"}))
    assert error is not None and "structured_outputs.json" in str(error) and "does not compile" in str(error)
    results, error = stream_request(server, llm_inputs("Hi", max_tokens=4, guided_regex="[a-"))
    assert error is not None and "structured_outputs.regex" in str(error)
    results, error = stream_request(server, llm_inputs("Hi", max_tokens=4, guided_choice=["yes", "no"], temperature=1.0))
    assert error is None and "".join(texts(results)) in ("yes", "no")
