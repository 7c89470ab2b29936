"""A tensor-parallel worker process (rank 1..N-1): `python -m pagedserve.backend.distributed.worker RANK SPEC_JSON`.

It loads its share of the model, allocates its share of the KV cache when rank 0
says how many blocks, then runs every step rank 0 sends until SHUTDOWN. It has no
scheduler, sampler or tokenizer: rank 0 decides everything. It exits on its own
when rank 0 dies: a collective with a dead peer fails at once, and a watchdog thread
sees the parent pid change (for a rank 0 that hangs rather than dies, nothing here
can tell; rank 0's timeouts handle that side).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

from ..device import DTYPES
from ..model_loader import load_checkpoint, read_checkpoint
from ..model_runner import ModelRunner
from ..models.parallel import TensorParallel
from .group import LOAD_TIMEOUT, CollectiveError, GroupCollectives, connect, join_store
from .step_channel import Command, StepChannel
from .workers import WorkerSpec

PARENT_POLL_S = 0.5


def main(argv: list[str]) -> int:
    rank, spec = int(argv[0]), WorkerSpec(**json.loads(argv[1]))
    _exit_with_parent(spec.parent_pid)
    device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(spec.num_threads or max(1, (os.cpu_count() or 1) // spec.size))

    store = join_store(spec.port, spec.size)
    store.set(f"worker/{rank}", str(os.getpid()))
    collectives = GroupCollectives(connect(store, rank, spec.size, device))
    channel = StepChannel(collectives, device)
    model = load_checkpoint(read_checkpoint(spec.model_path, spec.load_format), DTYPES[spec.dtype], device,
                            TensorParallel(rank, spec.size, collectives))
    if device.type == "cpu":  # tensor parallelism runs unquantized and eager, as rank 0 (backend/engine.py)
        from ..cpu.backend import prepare_rank

        prepare_rank(model)

    message = channel.receive()
    if message.command != Command.INIT:
        return 0  # rank 0 stopped before serving
    runner = ModelRunner(model, message.arg, spec.block_size, DTYPES[spec.dtype], device, spec.attention_backend)
    collectives.barrier(LOAD_TIMEOUT)
    while (message := channel.receive()).command == Command.STEP:
        assert message.inputs is not None  # a STEP carries its inputs
        runner.run(message.inputs)
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as rank 0 is gone (the worker is then reparented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except CollectiveError as error:  # rank 0 died or hung: nothing left to serve
        print(f"[pagedserve] tensor-parallel worker rank {sys.argv[1]} exits: rank 0 is gone ({error})", file=sys.stderr)
        sys.exit(1)
