"""A real tritonserver with our model repository, started once for the integration tests."""

from __future__ import annotations

import contextlib
import json
import queue
import time
import uuid
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from benchmarks.soak import IDLE_GAUGES, read_metrics
from pagedserve.client.process import ServerProcess, free_port, http_status
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer, TritonServerError

ENGINE = {
    "dtype": "float32",
    "max_num_seqs": "16",
    "max_queue_size": "8",
    "max_model_len": "1024",
    "kv_cache_bytes": str(256 * 1024**2),
    "REPORT_CUSTOM_METRICS": "true",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("triton")
    repository = write_repository(workdir / "model_repository", engine=ENGINE)
    triton = TritonServer(repository, log_file=workdir / "tritonserver.log")
    triton.start(timeout=300)
    try:
        yield triton
    finally:
        triton.stop()


@contextlib.contextmanager
def gateway_process(command: list[str], log_file, env: dict[str, str] | None = None) -> Iterator[str]:
    """`pagedserve openai` run as `command` on a free port (given with --port), its base URL once its
    /health answers 200; stopped at the end."""
    port = free_port()
    process = ServerProcess([*command, "--port", str(port)], log_file, name="pagedserve openai", env=env).start()
    try:
        process.wait_ready(lambda: http_status(f"http://localhost:{port}/health") == 200, time.monotonic() + 60)
        yield f"http://localhost:{port}"
    finally:
        process.stop()


def failed_load_log(repository, log_file, timeout: float, lines: int = 300, models: list[str] | None = None) -> str:
    """Start a server on `repository` (`models` alone, where named) that must fail to load; the tail of its log."""
    server = TritonServer(repository, log_file=log_file, models=models)
    with pytest.raises(TritonServerError):
        server.start(timeout=timeout)
    server.stop()
    return server.log_tail(lines)


def tensor(name: str, value: Any, dtype: str | None = None, shape: list[int] | None = None):
    array = np.array(value if isinstance(value, list) else [value])
    if dtype is None:
        dtype = {"b": "BOOL", "i": "INT32", "u": "UINT64", "f": "FP32"}.get(array.dtype.kind, "BYTES")
    if dtype == "BYTES":
        array = np.array([v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1)], dtype=np.object_)
    else:
        array = array.astype({"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_, "INT64": np.int64}[dtype])
    if shape is not None:
        array = array.reshape(shape)
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def stream_request(server, inputs, model: str = "llm", timeout: float = 120.0, cancel_after: int | None = None):
    """Send one streaming request; return (list of results, error or None)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    collected, error = [], None
    try:
        client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                break
            collected.append(result)
            if cancel_after is not None and len(collected) >= cancel_after:
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return collected, error


def texts(results) -> list[str]:
    return ["".join(t.decode() for t in r.as_numpy("text_output")) for r in results]


def llm_inputs(prompt: str | None = None, messages=None, stream: bool = True, **sampling):
    inputs = [tensor("messages", json.dumps(messages))] if messages is not None else [tensor("text_input", prompt)]
    inputs += [tensor("stream", stream), tensor("sampling_parameters", json.dumps(sampling))]
    if stream:
        inputs.append(tensor("exclude_input_in_output", True))
    return inputs


def metric(server, name: str) -> float:
    """Value of an unlabelled-by-us metric (summed over label sets) from the metrics port."""
    value = read_metrics(server.metrics_url, (name,))[name]
    if value is None:
        raise AssertionError(f"metric {name} not exported (or the metrics port did not answer)")
    return value


def wait_idle(server, timeout: float = 60.0) -> None:
    """Until no request runs or waits and no KV block is used, in two readings 0.3 s
    apart: the gauges refresh every 0.25 s, so one reading may predate a request (and
    right after a start they may not be exported yet)."""
    import time

    deadline = time.monotonic() + timeout
    idle_since = None
    while time.monotonic() < deadline:
        gauges = read_metrics(server.metrics_url, IDLE_GAUGES)  # None until first exported after a start
        if all(gauges[name] == 0 for name in IDLE_GAUGES):
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= 0.3:
                return
        else:
            idle_since = None
        time.sleep(0.1)
    raise AssertionError("the engine did not become idle")
