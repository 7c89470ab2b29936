"""An engine step that raises costs only the requests in that step: each gets one
error final, every KV block comes back, the failure is counted, and the next
request is served by the same server."""

from __future__ import annotations

import threading
import time

from pagedserve.client.client import LLMClient
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from .conftest import llm_inputs, metric, stream_request, wait_idle

FAULTY_MAX_TOKENS = 777  # a request asking for exactly this many tokens makes its step raise
HANGING_MAX_TOKENS = 778  # ... makes its first step hang for HANG_S
DEADLY_MAX_TOKENS = 779  # ... makes its step raise and the recovery after it too
HANG_S = 6.0

# llm's model.py (the engine's model) for this test only: the real adapter, with an engine whose
# forward raises while a request with the magic max_tokens is in the batch.
FAULTY_ENGINE_MODEL = f'''
import time

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.engine_model import TextEngineModel
from pagedserve.backend.triton_adapter.python_model import triton_python_model


class FaultyEngineModel(TextEngineModel):
    @classmethod
    def from_args(cls, pb_utils, args):
        model = super().from_args(pb_utils, args)
        engine = model.engine_thread.engine
        runner, recover = engine.runner, engine.recover_from_failure
        execute = runner.execute
        hung = set()

        def execute_or_fail(batch):
            asked = {{seq.params.max_tokens for seq in batch.seqs}}
            if {FAULTY_MAX_TOKENS} in asked or {DEADLY_MAX_TOKENS} in asked:
                raise RuntimeError("injected fault")
            if {HANGING_MAX_TOKENS} in asked and not hung:
                hung.add(1)
                time.sleep({HANG_S})
            return execute(batch)

        def recover_or_fail():
            if any(seq.params.max_tokens == {DEADLY_MAX_TOKENS} for seq in engine.scheduler.requests.values()):
                raise RuntimeError("injected recovery fault")
            recover()

        runner.execute = execute_or_fail
        engine.recover_from_failure = recover_or_fail
        return model


TritonPythonModel = triton_python_model(pb_utils, FaultyEngineModel)
'''


def test_a_failed_step_errors_its_requests_and_the_server_serves_the_next(tmp_path):
    repository = write_repository(tmp_path / "repo", engine={"dtype": "float32"})
    (repository / "llm" / "1" / "model.py").write_text(FAULTY_ENGINE_MODEL)
    with TritonServer(repository, log_file=tmp_path / "server.log", models=["llm"]).start(timeout=300) as server:
        wait_idle(server)
        bystander: dict = {}

        def long_request():
            bystander["result"] = stream_request(server, llm_inputs("Tell me a story:", max_tokens=400, ignore_eos=True))

        thread = threading.Thread(target=long_request)
        thread.start()
        results, error = stream_request(server, llm_inputs("Hello", max_tokens=FAULTY_MAX_TOKENS))
        thread.join(120)
        assert error is not None and "injected fault" in str(error) and "retry" in str(error)
        bystander_results, bystander_error = bystander["result"]
        # the bystander either finished before the fault or was in the failed step: one final either way
        assert bystander_error is not None or bystander_results
        deadline = time.monotonic() + 10  # the gauges refresh every 0.25 s
        while metric(server, "pagedserve:engine_recoveries_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(server, "pagedserve:engine_recoveries_total") == 1
        wait_idle(server, timeout=10)
        assert metric(server, "pagedserve:kv_blocks_used") == 0
        assert LLMClient(server.grpc_url).generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)


def wait_metric(server, name: str, value: float, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, name) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, name) == value


def test_a_hung_step_fails_its_requests_the_engine_says_not_ready_then_serves_again(tmp_path):
    """A step stuck past step_timeout_s: its request gets an error naming the setting within
    about the timeout, the engine_ready gauge drops to 0 and new requests are refused as
    unavailable; when the step returns the engine is rebuilt and serves, with no block held."""
    repository = write_repository(tmp_path / "repo", engine={"dtype": "float32", "step_timeout_s": "1"})
    (repository / "llm" / "1" / "model.py").write_text(FAULTY_ENGINE_MODEL)
    with TritonServer(repository, log_file=tmp_path / "server.log", models=["llm"]).start(timeout=300) as server:
        wait_idle(server)
        assert metric(server, "pagedserve:engine_ready") == 1
        start = time.monotonic()
        results, error = stream_request(server, llm_inputs("Hello", max_tokens=HANGING_MAX_TOKENS))
        assert error is not None and "step_timeout_s" in str(error)
        assert time.monotonic() - start < HANG_S - 1  # failed by the watchdog, not when the step returned
        wait_metric(server, "pagedserve:engine_ready", 0)
        _, refused = stream_request(server, llm_inputs("Hi", max_tokens=4))
        assert refused is not None and "hung" in str(refused)
        wait_metric(server, "pagedserve:engine_ready", 1, timeout=HANG_S + 10)
        wait_idle(server, timeout=10)
        assert metric(server, "pagedserve:kv_blocks_used") == 0
        assert LLMClient(server.grpc_url).generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)


def test_a_dead_engine_is_seen_and_every_request_is_refused_naming_it(tmp_path):
    """Recovery itself fails: the request gets an error final, the gauge says the engine is
    not serving, and later requests are refused as unavailable (never a hang)."""
    repository = write_repository(tmp_path / "repo", engine={"dtype": "float32"})
    (repository / "llm" / "1" / "model.py").write_text(FAULTY_ENGINE_MODEL)
    with TritonServer(repository, log_file=tmp_path / "server.log", models=["llm"]).start(timeout=300) as server:
        wait_idle(server)
        _, error = stream_request(server, llm_inputs("Hello", max_tokens=DEADLY_MAX_TOKENS))
        assert error is not None and "injected" in str(error)
        wait_metric(server, "pagedserve:engine_ready", 0)
        _, refused = stream_request(server, llm_inputs("Hi", max_tokens=4), timeout=30)
        assert refused is not None and "restart the model" in str(refused)
