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


def samples(results) -> list[str]:
    """Each sample's whole text from a streamed `llm` response (n entries per response)."""
    joined: list[str] = []
    for result in results:
        for i, piece in enumerate(result.as_numpy("text_output").reshape(-1)):
            if i == len(joined):
                joined.append("")
            joined[i] += piece.decode()
    return joined


def test_170_seeded_requests_over_20_schemas_3_regexes_and_a_grammar_all_validate(server):
    """Temperature 1.0, one seed each: through `llm` (vLLM's keys, old and new, and compact
    JSON; every tenth request n = 4) and the TensorRT-LLM ensemble, every answer parses and validates, and the
    shared preamble is served from the prefix cache. (The gateway's 30 of the 200 are in
    test_openai_gateway.py, against its own server.)"""
    from concurrent.futures import ThreadPoolExecutor

    from .conftest import metric
    from .structured_cases import CASES, prompt
    from .test_trtllm_contract import trt_inputs

    hits_before = metric(server, "pagedserve:prefix_cache_hits_total")

    def run(index: int) -> tuple[int, list[str]]:
        case = CASES[index % len(CASES)]
        if index < 140:
            sampling = dict(max_tokens=160, temperature=1.0, seed=index, n=4 if index % 10 == 3 else 1,
                            **case.vllm(old_keys=index % 3 == 1, compact=index % 3 == 2))
            results, error = stream_request(server, llm_inputs(prompt(index), **sampling))
            assert error is None, (index, error)
            return index, samples(results)
        values = dict(temperature=1.0, seed=index, exclude_input_in_output=True, **case.trtllm())
        results, error = stream_request(server, trt_inputs(prompt(index), 160, **values), model="ensemble")
        assert error is None, (index, error)
        return index, ["".join(r.as_numpy("text_output")[0].decode() for r in results)]

    with ThreadPoolExecutor(16) as pool:  # the server's max_num_seqs
        answers = dict(pool.map(run, range(170)))
    checked = 0
    for index, texts_of_request in sorted(answers.items()):
        assert len(texts_of_request) == (4 if index < 140 and index % 10 == 3 else 1)
        for text in texts_of_request:
            CASES[index % len(CASES)].check(text)
            checked += 1
    assert checked == 170 + 14 * 3
    assert metric(server, "pagedserve:prefix_cache_hits_total") > hits_before
