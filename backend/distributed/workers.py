"""WorkerPool: rank 0's side of ranks 1..N-1 — spawn them, tell them what to run,
name the one that died, restart them, stop them.

Each worker is `python -m pagedserve.backend.distributed.worker` in its own session
(terminal signals and Triton's process-group kill do not reach it; its lifetime is
rank 0's business). It ends on the SHUTDOWN command, and on its own when rank 0 dies
(a broken collective, or its parent pid changing), so nothing outlives rank 0.
Rank 0 also kills every worker when the pool is garbage-collected or the
interpreter exits.

A failed step: if a worker died, the error names its rank, pid and exit code. A step
that did not finish on every rank leaves the group out of step, so `recover` then
kills the workers and starts new ones (rank 0 keeps its weights and KV cache); if
that fails too, the engine is dead and refuses requests (engine_thread.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..errors import ConfigError, PagedServeError
from ..model_loader import read_checkpoint
from ..model_runner import ModelInputs
from ..models.parallel import TensorParallel, check_tensor_parallel
from .group import CONNECT_TIMEOUT, LOAD_TIMEOUT, CollectiveError, GroupCollectives, connect, host_store
from .step_channel import Command, StepChannel

logger = logging.getLogger("pagedserve")
WORKER_MODULE = "pagedserve.backend.distributed.worker"
SHUTDOWN_WAIT_S = 10.0
EXIT_REAP_S = 5.0  # a dying worker closes its sockets before it can be reaped: a killed one a moment before, one that
# failed on its own (a traceback, then torch's interpreter teardown) up to seconds before on a busy 2-core machine


class TensorParallelError(PagedServeError):
    """A tensor-parallel worker died or stopped answering; the step it was in failed."""


@dataclass
class WorkerSpec:
    """What a worker needs to load its share of the model (JSON on its command line)."""

    model_path: str
    dtype: str
    device: str
    block_size: int
    attention_backend: str
    num_threads: int
    size: int
    port: int = 0
    parent_pid: int = 0
    load_format: str = "auto"


def start_workers(config: EngineConfig, model_path: str, dtype: torch.dtype, device: torch.device) -> WorkerPool | None:
    """The pool of ranks 1..N-1 for `tensor_parallel_size` N, running and connected; None for 1.

    The model's shapes are checked first, so a size that does not split it fails here
    (ConfigError naming tensor_parallel_size) before any process starts."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_tensor_parallel(read_checkpoint(model_path).config, size)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            "tensor_parallel_size",
            f"{size} ranks need {size} GPUs (one each), {torch.cuda.device_count()} are visible; "
            "lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
        )
    spec = WorkerSpec(model_path, str(dtype).removeprefix("torch."), device.type, config.block_size,
                      config.attention_backend, config.num_threads, size, parent_pid=os.getpid(),
                      load_format=config.load_format)
    return WorkerPool(spec, device)


class WorkerPool:
    def __init__(self, spec: WorkerSpec, device: torch.device):
        self.spec = spec
        self.device = device
        self.collectives = GroupCollectives()
        self.parallel = TensorParallel(0, spec.size, self.collectives)
        """Rank 0's place in the group; its layers keep it across restarts."""
        self.channel = StepChannel(self.collectives, device)
        self.processes: list[subprocess.Popen] = []
        self.num_blocks = 0
        self.in_step = False
        """A step was sent and has not finished on rank 0: the workers may be mid-step."""
        self.closed = False
        self._finalizer: weakref.finalize | None = None
        self._start()

    # -- lifecycle -----------------------------------------------------------------
    def _start(self) -> None:
        store = host_store(self.spec.size)
        spec = dataclasses.replace(self.spec, port=store.port)
        self.processes = [_spawn(spec, rank) for rank in range(1, spec.size)]
        self._finalizer = weakref.finalize(self, _kill, list(self.processes))
        with self._killing_on_error():
            self._await_announcements(store)
            self.collectives.groups = connect(store, 0, spec.size, self.device)
        logger.info("tensor parallel: %d worker processes started (pids %s)",
                    len(self.processes), [p.pid for p in self.processes])

    def _await_announcements(self, store: dist.Store) -> None:
        """Until every worker has joined the store (then it connects at once); a worker
        that exits first fails the start with its exit code."""
        deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
        waiting = {rank: f"worker/{rank}" for rank in range(1, self.spec.size)}
        while waiting:
            self._raise_if_dead("while starting")
            waiting = {rank: key for rank, key in waiting.items() if not store.check([key])}
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers {sorted(waiting)} did not start within "
                                          f"{CONNECT_TIMEOUT.total_seconds():.0f}s")
            time.sleep(0.02)

    def init_workers(self, num_blocks: int) -> None:
        """Have every worker allocate `num_blocks` KV blocks and wait until all are ready
        (this is where rank 0 waits for workers still loading their weights)."""
        self.num_blocks = num_blocks
        with self._killing_on_error(), self.naming_failures():
            self.channel.send_command(Command.INIT, num_blocks, timeout=LOAD_TIMEOUT)
            self.collectives.barrier(LOAD_TIMEOUT)

    def send_step(self, inputs: ModelInputs) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers were stopped (the engine was closed)")
        self.in_step = True
        self.channel.send_step(inputs)

    def end_step(self) -> None:
        self.in_step = False

    def recover(self) -> None:
        """After a failed step: nothing to do if every worker is alive and between steps;
        else kill them all and start new ones (rank 0 keeps its weights and KV cache)."""
        if self.closed or (not self.in_step and all(p.poll() is None for p in self.processes)):
            return
        started = time.monotonic()
        self._stop_processes()
        self._start()
        self.init_workers(self.num_blocks)
        self.in_step = False
        logger.warning("tensor parallel: workers restarted in %.1fs", time.monotonic() - started)

    def close(self) -> None:
        """Stop every worker: SHUTDOWN when they are between steps, else (or if they do
        not exit in SHUTDOWN_WAIT_S) SIGKILL. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.in_step and all(p.poll() is None for p in self.processes):
            try:
                self.channel.send_command(Command.SHUTDOWN)
            except CollectiveError:
                pass  # a worker died meanwhile: killed below
            _wait_exit(self.processes, SHUTDOWN_WAIT_S)
        self._stop_processes()
        logger.info("tensor parallel: workers stopped")

    def _stop_processes(self) -> None:
        _kill(self.processes)
        self.collectives.groups = None
        if self._finalizer is not None:
            self._finalizer.detach()

    @contextlib.contextmanager
    def _killing_on_error(self) -> Iterator[None]:
        """A start that fails leaves no worker waiting for a rank 0 that gave up on it."""
        try:
            yield
        except BaseException:
            self._stop_processes()
            raise

    # -- failures ------------------------------------------------------------------
    @contextlib.contextmanager
    def naming_failures(self) -> Iterator[None]:
        """A failed collective inside becomes a TensorParallelError naming the worker
        that died (or saying that none did: a hang)."""
        try:
            yield
        except CollectiveError as error:
            raise self.failure(error) from error

    def failure(self, error: BaseException) -> TensorParallelError:
        deadline = time.monotonic() + EXIT_REAP_S
        while time.monotonic() < deadline:
            dead = self._dead_worker()
            if dead is not None:
                return TensorParallelError(dead)
            time.sleep(0.02)
        return TensorParallelError(f"a tensor-parallel collective failed while every worker is still running "
                                   f"(one hung?): {error}")

    def _raise_if_dead(self, when: str) -> None:
        dead = self._dead_worker()
        if dead is not None:
            raise TensorParallelError(f"{dead} {when}; its error is in the log above")

    def _dead_worker(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                return f"tensor-parallel worker rank {rank} (pid {process.pid}) died: {_describe_exit(code)}"
        return None


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code} (its traceback is in the log)"


def _spawn(spec: WorkerSpec, rank: int) -> subprocess.Popen:
    env = dict(os.environ)
    # the worker imports exactly what rank 0 does (Triton's stub adds its own paths)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    command = [python_executable(), "-m", WORKER_MODULE, str(rank), json.dumps(dataclasses.asdict(spec))]
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def python_executable() -> str:
    """This interpreter, also when it is embedded (Triton's python backend stub, whose
    sys.executable may be the stub itself)."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    candidate = os.path.join(sys.prefix, "bin", "python3")
    return candidate if os.path.exists(candidate) else shutil.which("python3") or "python3"


def _wait_exit(processes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _kill(processes: list[subprocess.Popen]) -> None:
    """SIGKILL and reap every worker still running (also the pool's finalizer)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()
