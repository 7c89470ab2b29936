"""tensor_parallel_size=2 through a real tritonserver: the llm stub (the engine's model) spawns its worker,
greedy text equals the offline single-rank engine's, and stopping the server ends the
worker through the engine's own shutdown (the log says so), leaving no process behind."""

from __future__ import annotations

import time

import psutil

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.distributed.workers import WORKER_MODULE
from pagedserve.client.client import LLMClient
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from ..tensor_parallel_checks import worker_processes

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was", "Printers in Venice, Paris and Antwerp"]


def workers_of(model_path: str) -> list[psutil.Process]:
    """Live worker processes serving `model_path`, wherever they are in the process tree."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if WORKER_MODULE in cmdline and model_path in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def test_tensor_parallel_2_serves_the_single_rank_text_and_leaves_no_worker(tmp_path, small_llama):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    offline = LLMEngine(model=small_llama, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    repository = write_repository(tmp_path / "repo", model=small_llama,
                                  engine={"dtype": "float32", "tensor_parallel_size": "2"})
    log_file = tmp_path / "server.log"
    with TritonServer(repository, log_file=log_file, models=["llm"]).start(timeout=300) as server:
        (worker,) = worker_processes(psutil.Process(server.pid))  # below the llm stub
        client = LLMClient(server.grpc_url)
        served = [client.generate(p, max_tokens=16, temperature=0, ignore_eos=True) for p in PROMPTS]
        assert served == [c.text for c in offline]
    deadline = time.monotonic() + 10
    while workers_of(small_llama) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers_of(small_llama) and not worker.is_running()
    assert "tensor parallel: workers stopped" in log_file.read_text()
