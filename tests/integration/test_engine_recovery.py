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

# llm's model.py (the engine's model) for this test only: the real adapter, with an engine whose
# forward raises while a request with the magic max_tokens is in the batch.
FAULTY_ENGINE_MODEL = f'''
import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.engine_model import TextEngineModel
from pagedserve.backend.triton_adapter.python_model import triton_python_model


class FaultyEngineModel(TextEngineModel):
    @classmethod
    def from_args(cls, pb_utils, args):
        model = super().from_args(pb_utils, args)
        runner = model.engine_thread.engine.runner
        execute = runner.execute

        def execute_or_fail(batch):
            if any(seq.params.max_tokens == {FAULTY_MAX_TOKENS} for seq in batch.seqs):
                raise RuntimeError("injected fault")
            return execute(batch)

        runner.execute = execute_or_fail
        return model


TritonPythonModel = triton_python_model(pb_utils, FaultyEngineModel)
'''


def test_a_failed_step_errors_its_requests_and_the_server_serves_the_next(tmp_path):
    repository = write_repository(tmp_path / "repo", engine={"dtype": "float32"})
    (repository / "llm" / "1" / "model.py").write_text(FAULTY_ENGINE_MODEL)
    with TritonServer(repository, log_file=tmp_path / "server.log").start(timeout=300) as server:
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
