"""Every bad request gets an error naming the field and the fix; the server keeps serving."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient

from pagedserve.client.client import LLMClient

from .conftest import stream_request, tensor, wait_idle


def good_request_still_works(server):
    assert LLMClient(server.grpc_url).generate("Hello", max_tokens=3, temperature=0)


BAD = {
    "missing text_input": ([tensor("stream", True)], "text_input"),
    "empty prompt": ([tensor("text_input", "")], "text_input"),
    "prompt longer than max_model_len": ([tensor("text_input", "word " * 1200)], "prompt"),
    "bad JSON": ([tensor("text_input", "Hi"), tensor("sampling_parameters", "{max_tokens: 5")], "sampling_parameters"),
    "unknown sampling key": ([tensor("text_input", "Hi"), tensor("sampling_parameters", json.dumps({"temprature": 1}))], "temprature"),
    "out-of-range value": ([tensor("text_input", "Hi"), tensor("sampling_parameters", json.dumps({"top_p": 1.5}))], "top_p"),
    "string that is no number": ([tensor("text_input", "Hi"), tensor("sampling_parameters", json.dumps({"max_tokens": "lots"}))], "max_tokens"),
    "wrong dtype": ([tensor("text_input", "Hi"), tensor("max_tokens", 2.5, "FP32")], "max_tokens"),
    "wrong shape": ([tensor("text_input", ["a", "b"], "BYTES")], "text_input"),
    "stream without excluding the input": (
        [tensor("text_input", "Hi"), tensor("stream", True), tensor("exclude_input_in_output", False)],
        "exclude_input_in_output",
    ),
    "non-UTF-8 bytes": ([tensor("text_input", [b"\xff\xfe bad"], "BYTES")], "UTF-8"),
    "bad chat messages": ([tensor("messages", json.dumps([{"role": "user"}]))], "messages[0]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_a_named_error_and_the_server_stays_healthy(server, case):
    inputs, field = BAD[case]
    results, error = stream_request(server, inputs, timeout=60)
    assert error is not None, f"{case}: expected an error, got {len(results)} responses"
    assert field in str(error), f"{case}: {error}"
    good_request_still_works(server)


def test_queue_full_is_refused_at_once_with_busy(server):
    """16 run, 8 wait (max_queue_size); more are refused at once with "busy, retry later".

    We answer with Triton's UNAVAILABLE code; Triton 2.51 itself turns any error of a
    decoupled model into HTTP 400 and gRPC stream errors carry only the message."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors: list = []
    client.start_stream(callback=lambda result, error: errors.append(error) if error is not None else None)
    params = json.dumps({"max_tokens": 400, "ignore_eos": True, "temperature": 0})
    try:
        for i in range(30):
            client.async_stream_infer("llm", [tensor("text_input", f"Story {i}:"), tensor("stream", True),
                                              tensor("sampling_parameters", params)], request_id=f"flood-{i}")
        deadline = time.monotonic() + 60
        while not any("busy" in str(e) for e in errors) and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = [e for e in errors if "busy" in str(e)]
        assert busy and "retry later" in str(busy[0])
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(
                f"http://{server.http_url}/v2/models/llm/generate",
                data=json.dumps({"text_input": "one more", "sampling_parameters": params}).encode()), timeout=30)
        assert info.value.code in (400, 503) and b"busy" in info.value.read()
        assert time.monotonic() - started < 5
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    wait_idle(server)
    good_request_still_works(server)
