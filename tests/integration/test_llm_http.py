"""HTTP generate and generate_stream (SSE) with plain HTTP; TensorRT-LLM-style inputs;
token ids straight to `llm` (the engine's model) and through its relay `llm_engine`."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from pagedserve.backend import SamplingParams

from .conftest import stream_request, tensor


def post(server, path: str, body: dict, timeout: float = 120):
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=timeout)


def sse_events(response) -> list[dict]:
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:"):
            events.append(json.loads(line[5:]))
    return events


def test_http_generate_returns_the_whole_text(server, engine):
    body = {"text_input": "The capital of Italy is", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": "12", "temperature": "0"}), "return_finish_reason": True}
    reply = json.load(post(server, "/v2/models/llm/generate", body))
    [offline] = engine.generate(["The capital of Italy is"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert reply["text_output"] == offline.text
    assert reply["finish_reason"] == "length"


def test_http_generate_stream_sse_concatenates_to_the_same_text(server, engine):
    body = {"text_input": "List three fruits:", "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 20, "temperature": 0})}
    events = sse_events(post(server, "/v2/models/llm/generate_stream", body))
    assert len(events) > 3
    [offline] = engine.generate(["List three fruits:"], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert "".join(e["text_output"] for e in events) == offline.text


def test_tensorrt_llm_style_inputs(server, engine):
    inputs = [
        tensor("text_input", "Name a color:"),
        tensor("max_tokens", 10, "INT32"),
        tensor("temperature", 0.0, "FP32"),
        tensor("stop_words", ["\n\n"], "BYTES"),
        tensor("seed", 3, "UINT64"),
        tensor("stream", True),
    ]
    results, error = stream_request(server, inputs)
    assert error is None
    [offline] = engine.generate(["Name a color:"], SamplingParams(max_tokens=10, temperature=0, stop=["\n\n"]), use_tqdm=False)
    assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == offline.text


def test_tensorrt_llm_sampling_with_a_seed_is_reproducible(server):
    def run():
        inputs = [tensor("text_input", "A poem about snow:"), tensor("max_tokens", 16, "INT32"),
                  tensor("temperature", 1.0, "FP32"), tensor("top_p", 0.9, "FP32"), tensor("random_seed", 11, "UINT64")]
        results, error = stream_request(server, inputs)
        assert error is None
        return "".join(r.as_numpy("text_output")[0].decode() for r in results)
    assert run() == run()


@pytest.mark.parametrize("model", ["llm", "llm_engine"])
def test_token_ids_in_and_out(server, engine, model):
    ids = engine.encode(messages=[{"role": "user", "content": "What is the capital of France?"}])
    inputs = [tensor("input_ids", ids, "INT32"), tensor("stream", True),
              tensor("sampling_parameters", json.dumps({"max_tokens": 30, "temperature": 0})),
              tensor("return_num_input_tokens", True), tensor("return_num_output_tokens", True)]
    results, error = stream_request(server, inputs, model=model)
    assert error is None
    generated = [int(t) for r in results for t in r.as_numpy("output_ids")]
    [offline] = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)
    assert generated == offline.token_ids
    assert results[0].as_numpy("num_input_tokens")[0] == len(ids)
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == len(generated)
    assert results[0].as_numpy("context_ids").tolist() == ids[-4:]


def test_logprob_outputs_follow_the_vllm_backend_shape(server):
    inputs = [tensor("text_input", "The sky is"), tensor("stream", True), tensor("exclude_input_in_output", True),
              tensor("sampling_parameters", json.dumps({"max_tokens": 3, "temperature": 0, "logprobs": 2})),
              tensor("return_logprobs", True), tensor("return_cumulative_logprob", True)]
    results, error = stream_request(server, inputs)
    assert error is None
    positions = [p for r in results for p in json.loads(r.as_numpy("logprobs")[0])]
    assert len(positions) == 3 and all(len(p) >= 2 for p in positions)
    total = sum(max(v["logprob"] for v in p.values()) for p in positions)  # greedy: the sampled token is the top one
    assert np.isclose(results[-1].as_numpy("cumulative_logprob")[0], total, atol=1e-4)
