"""Every request ends, whatever its client does: exactly one final response each; a
cancel right behind its request frees its KV blocks; and a server with a cancelled
stream behind it stops at once instead of waiting out its exit timeout (a request
without a final keeps its model loaded in Triton).

The clean-stop test cancels requests once `llm` has received them (Triton's
statistics say when), so each run exercises the same path. Before cancelled
requests got flag-only finals, one server in five kept `llm` loaded to its exit
timeout after twenty such cancels, with every request answered (engine_model.py); it
still happens now and then (`assert_triton_held_an_answered_llm`)."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request

import pytest
import tritonclient.grpc as grpcclient

from pagedserve.client.client import LLMClient
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from .conftest import ENGINE, llm_inputs, metric, stream_request, tensor, wait_idle

LONG = {"max_tokens": 800, "ignore_eos": True}


def wait_metrics(server, timeout: float = 30.0) -> None:
    """Triton starts its metrics port a moment after it reports ready."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            metric(server, "pagedserve:kv_blocks_used")
            return
        except (OSError, AssertionError):
            assert time.monotonic() < deadline, "metrics never exported"
            time.sleep(0.1)


def llm_executions(client) -> int:
    """How many requests `llm` has been handed (Triton's statistics count them on execute)."""
    stats = client.get_inference_statistics("llm", as_json=True)["model_stats"]
    return sum(int(s.get("execution_count", 0)) for s in stats)


def cancel_once_received(server) -> None:
    """A long stream cancelled before its first token, once `llm` has received it."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = llm_executions(client)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer("llm", llm_inputs("Tell me a very long story:", **LONG), request_id="received")
    deadline = time.monotonic() + 30
    while llm_executions(client) == before:
        assert time.monotonic() < deadline, "llm never received the request"
        time.sleep(0.005)
    client.stop_stream(cancel_requests=True)
    client.close()


def cancel_right_behind(server, delay_ms: float) -> None:
    """A long stream whose client cancels `delay_ms` after sending it."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer("llm", llm_inputs("Tell me a very long story:", **LONG), request_id=f"early-{delay_ms}")
    time.sleep(delay_ms / 1000)
    client.stop_stream(cancel_requests=True)
    client.close()


@pytest.mark.parametrize("delay_ms", [0, 1, 2, 5])
def test_a_cancel_right_behind_its_request_frees_its_blocks(server, delay_ms):
    wait_metrics(server)
    wait_idle(server)
    cancel_right_behind(server, delay_ms)
    wait_idle(server, timeout=10)  # not 800 tokens later
    assert metric(server, "pagedserve:kv_blocks_used") == 0
    assert LLMClient(server.grpc_url).generate("Hi", max_tokens=4, temperature=0)


def test_every_request_gets_exactly_one_final(server):
    """Good and bad requests on one stream, streaming or not: one final each, nothing after it."""
    requests = {
        "stream": llm_inputs("Count to three:", max_tokens=6, temperature=0),
        "whole": llm_inputs("Count to three:", stream=False, max_tokens=6, temperature=0),
        "empty": [tensor("text_input", "")],
        "bad-json": [tensor("text_input", "Hi"), tensor("sampling_parameters", "{oops")],
        "bad-key": [tensor("text_input", "Hi"), tensor("stream", True), tensor("sampling_parameters", json.dumps({"temprature": 1}))],
    }
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for request_id, inputs in requests.items():
            client.async_stream_infer("llm", inputs, request_id=request_id, enable_empty_final_response=True)
        finals: dict[str, int] = {}
        after_final: list[str] = []
        deadline = time.monotonic() + 120
        while len(finals) < len(requests) and time.monotonic() < deadline:
            try:
                result, error = results.get(timeout=1)
            except queue.Empty:
                continue
            if error is not None:  # gRPC stream errors carry no request id: one per bad request
                finals[f"error-{len(finals)}"] = 1
                continue
            response = result.get_response()
            if response.id in finals:
                after_final.append(response.id)
            if response.parameters["triton_final_response"].bool_param:
                finals[response.id] = finals.get(response.id, 0) + 1
        time.sleep(1)  # anything late would arrive now
        while not results.empty():
            result, error = results.get()
            after_final.append(error or result.get_response().id)
    finally:
        client.stop_stream()
        client.close()
    assert len(finals) == len(requests) and set(finals.values()) == {1}
    assert {"stream", "whole"} <= set(finals) and not after_final


def test_stop_after_cancelled_and_closed_streams_is_clean(tmp_path):
    """Each request got its final: otherwise `llm` stays loaded until the exit timeout."""
    repository = write_repository(tmp_path / "repo", engine=ENGINE)
    server = TritonServer(repository, log_file=tmp_path / "server.log", models=["llm"])
    server.start(timeout=300)
    try:
        results, error = stream_request(server, llm_inputs("Tell me a very long story:", **LONG), cancel_after=3)
        assert error is None and len(results) == 3
        body = {"text_input": "Another long story:", "stream": True, "sampling_parameters": json.dumps(LONG)}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate_stream", data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            for seen, line in enumerate(line for line in response if line.startswith(b"data:")):
                if seen == 2:
                    break
        for _ in range(3):
            cancel_once_received(server)
        assert LLMClient(server.grpc_url).generate("Hi", max_tokens=4, temperature=0)
        wait_metrics(server)
        wait_idle(server, timeout=10)
    finally:
        started = time.monotonic()
        server.stop()
        stopped_in = time.monotonic() - started
    log = (tmp_path / "server.log").read_text()
    assert "Fatal Python error" not in log and "after its client cancelled it" in log
    if "Exit timeout expired" in log:
        assert_triton_held_an_answered_llm(log)
    assert "successfully unloaded 'llm' version 1" in log, log[-6000:]
    assert stopped_in < 10


def assert_triton_held_an_answered_llm(log: str) -> None:
    """tritonserver 2.51 still, rarely (about one full suite run in three here, none in
    runs of this file alone), keeps `llm` referenced after every request it was handed
    has been answered, and waits out its exit timeout: a race in its gRPC frontend's
    cancellation, which Triton fixed after 2.51 (server PRs #7840, #8078). Where each
    cancelled request was ended in the engine (and so given its final, engine_model.py)
    and Triton reports no inference in flight, that is this known issue: xfail, not pass."""
    aborted = re.findall(r"aborted request (\S+) in the engine after its client cancelled it", log)
    assert aborted, f"no cancelled request was ended in the engine\n{log[-6000:]}"
    assert "Found 0 model versions that have in-flight inferences" in log, log[-6000:]
    pytest.xfail("tritonserver 2.51 held 'llm' to its exit timeout with every request answered (its gRPC "
                 "cancellation race, fixed after 2.51)")
