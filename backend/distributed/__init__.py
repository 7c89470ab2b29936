"""Tensor parallelism over torch.distributed: the engine is rank 0 and spawns ranks
1..N-1 as worker processes; per step rank 0 broadcasts the flat inputs and every rank
runs its share of the model (models/parallel.py). group.py: process groups and
collectives; step_channel.py: the per-step broadcast; workers.py: spawning, failures,
restarts, shutdown; worker.py: the worker process; runner.py: rank 0's runner.
Tested on CPU with gloo; the NCCL (CUDA) path is present but has not run."""

from .runner import TensorParallelRunner
from .workers import TensorParallelError, WorkerPool, start_workers

__all__ = ["TensorParallelError", "TensorParallelRunner", "WorkerPool", "start_workers"]
