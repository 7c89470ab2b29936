"""Model load and unload: bad parameters fail loudly, --allow-metrics=false is fine, and a
server stopped with a request in flight exits within its exit timeout.

Triton (2.51) calls a model's finalize() only once every request has its final
response, and tells a decoupled model nothing before: a stream still generating
holds shutdown until --exit-timeout-secs; the launcher then kills what is left."""

from __future__ import annotations

import threading
import time

from pagedserve.client.client import LLMClient
from pagedserve.client.repository import set_parameters, write_repository
from pagedserve.client.triton_server import TritonServer

from .conftest import failed_load_log


def test_unknown_engine_parameter_fails_the_load_naming_it(tmp_path):
    repository = write_repository(tmp_path / "repo")
    set_parameters(repository / "llm" / "config.pbtxt", {"max_batch_tokens": "99"})
    assert "max_batch_tokens" in failed_load_log(repository, tmp_path / "server.log", timeout=120, lines=200,
                                                   models=["llm"])


def test_metrics_disabled_by_the_server_and_stop_with_requests_in_flight(tmp_path):
    repository = write_repository(tmp_path / "repo", engine={"dtype": "float32"})
    server = TritonServer(repository, extra_args=["--allow-metrics=false"], exit_timeout_s=5, log_file=tmp_path / "server.log",
                          models=["llm"])
    server.start(timeout=300)
    try:
        client = LLMClient(server.grpc_url)
        assert client.generate("Hello", max_tokens=4, temperature=0)
        outcome: dict = {}

        def long_stream():
            try:
                outcome["text"] = client.generate("A long tale:", max_tokens=2000, ignore_eos=True)
            except Exception as error:  # the server going away cancels it
                outcome["error"] = error

        thread = threading.Thread(target=long_stream)
        thread.start()
        time.sleep(2)
    finally:
        started = time.monotonic()
        server.stop()  # exit timeout (5 s) + 10 s, then SIGKILL
        stopped_in = time.monotonic() - started
    thread.join(30)
    assert not thread.is_alive()
    assert "error" in outcome
    assert stopped_in < 25
