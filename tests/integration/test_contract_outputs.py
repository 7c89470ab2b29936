"""The vLLM backend's output contract on a real server: an output comes only when its
return_* flag is set (and, when the client names outputs, only if named), with the
vLLM backend's values; over gRPC streaming and not, HTTP generate and generate_stream."""

from __future__ import annotations

import json
import queue
import urllib.request
import uuid

import pytest
import tritonclient.grpc as grpcclient

from .conftest import stream_request, tensor

RETURNS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
PROMPT = "In this example,"
MAX_TOKENS = 5
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def grpc_llm(server, inputs, outputs=None, parameters=None) -> list:
    """Every response of one request on a gRPC stream, up to the final one."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
        client.async_stream_infer("llm", inputs, outputs=requested, request_id=uuid.uuid4().hex, parameters=parameters)
        collected = []
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            collected.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return collected
    finally:
        client.stop_stream()
        client.close()


def llm_inputs(stream: bool, flags: dict[str, bool], sampling: dict | None = SAMPLING) -> list:
    inputs = [tensor("text_input", PROMPT), tensor("stream", stream)]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", json.dumps(sampling)))
    return inputs + [tensor(name, value) for name, value in flags.items()]


def post(server, path: str, body: dict):
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


@pytest.mark.parametrize("flag", sorted(RETURNS))
@pytest.mark.parametrize("value", [True, False, None])
def test_grpc_stream_output_present_only_when_its_flag_is_set(server, flag, value):
    results = grpc_llm(server, llm_inputs(True, {} if value is None else {flag: value}))
    assert len(results) > 1
    for result in results:
        assert result.as_numpy("text_output") is not None
        for name in RETURNS.values():
            assert (result.as_numpy(name) is not None) == (name == RETURNS[flag] and bool(value)), name


def test_grpc_stream_values_follow_the_vllm_backend(server):
    results = grpc_llm(server, llm_inputs(True, dict.fromkeys(RETURNS, True)))
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
    assert reasons == ["None"] * (len(results) - 1) + ["length"]
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in results]
    assert all(c > 0 for c in counts) and sum(counts) == MAX_TOKENS  # per response, not cumulative
    assert all(0 < int(r.as_numpy("num_input_tokens")[0]) <= len(PROMPT) for r in results)
    assert all(json.loads(r.as_numpy("logprobs")[0]) is None for r in results)  # no `logprobs` sampling parameter
    cumulative = [float(r.as_numpy("cumulative_logprob")[0]) for r in results]
    assert all(b <= a + 1e-6 for a, b in zip([0.0] + cumulative, cumulative)) and cumulative[-1] < 0


def test_logprobs_match_the_streamed_text(server):
    results = grpc_llm(server, llm_inputs(True, {"return_logprobs": True, "return_num_output_tokens": True},
                                          SAMPLING | {"logprobs": 2}))
    for result in results:
        positions = json.loads(result.as_numpy("logprobs")[0])
        assert len(positions) == int(result.as_numpy("num_output_tokens")[0])
        text = ""
        for position in positions:
            assert 1 <= len(position) <= 3
            [top] = [entry for entry in position.values() if entry["rank"] == 1]
            assert set(top) == {"logprob", "rank", "decoded_token"}
            text += top["decoded_token"]
        assert text == result.as_numpy("text_output")[0].decode()  # greedy: the sampled token ranks first


def test_sampling_parameters_as_request_parameters(server):
    parameters = {"max_tokens": str(MAX_TOKENS), "temperature": "0", "ignore_eos": True}
    results = grpc_llm(server, llm_inputs(True, {"return_num_output_tokens": True}, sampling=None), parameters=parameters)
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == MAX_TOKENS


@pytest.mark.parametrize("value", [True, False])
def test_grpc_non_streaming_one_response_with_only_the_flagged_outputs(server, value):
    [result] = grpc_llm(server, llm_inputs(False, dict.fromkeys(RETURNS, value)))
    assert result.as_numpy("text_output")[0].decode().startswith(PROMPT)  # the prompt first, as vLLM's backend does
    for name in RETURNS.values():
        assert (result.as_numpy(name) is not None) == value
    if value:
        assert result.as_numpy("finish_reason")[0] == b"length"
        assert int(result.as_numpy("num_output_tokens")[0]) == MAX_TOKENS


@pytest.mark.parametrize("names", [["finish_reason"], ["text_output", "num_output_tokens"]])
def test_a_client_naming_outputs_gets_only_those(server, names):
    results = grpc_llm(server, llm_inputs(True, dict.fromkeys(RETURNS, True)), outputs=names)
    for result in results:
        assert sorted(o.name for o in result.get_response().outputs) == sorted(names)


@pytest.mark.parametrize("value", [True, False])
def test_http_generate_has_only_the_flagged_outputs(server, value):
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(SAMPLING)} | dict.fromkeys(RETURNS, value)
    reply = json.load(post(server, "/v2/models/llm/generate", body))
    assert reply["text_output"].startswith(PROMPT)
    assert {name for name in RETURNS.values() if name in reply} == (set(RETURNS.values()) if value else set())


@pytest.mark.parametrize("value", [True, False])
def test_http_generate_stream_has_only_the_flagged_outputs(server, value):
    body = {"text_input": PROMPT, "stream": True, "sampling_parameters": json.dumps(SAMPLING)} | dict.fromkeys(RETURNS, value)
    events = [json.loads(line[5:]) for line in post(server, "/v2/models/llm/generate_stream", body)
              if line.startswith(b"data:")]
    assert len(events) > 1
    for event in events:
        assert {name for name in RETURNS.values() if name in event} == (set(RETURNS.values()) if value else set())
    if value:
        assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]


def test_streaming_with_the_input_is_refused_in_the_vllm_backend_words(server):
    inputs = [tensor("text_input", PROMPT), tensor("stream", True), tensor("exclude_input_in_output", False)]
    results, error = stream_request(server, inputs)
    assert not results
    assert error.message() == "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
