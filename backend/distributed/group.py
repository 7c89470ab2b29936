"""The process groups of one tensor-parallel engine, and the collectives over them.

Rank 0 hosts a TCPStore on a free local port; every rank builds two groups on it:
- control (gloo, CPU): rank 0's per-step header. A worker waits on it between steps
  for as long as the engine stays idle (IDLE_TIMEOUT).
- model (gloo on CPU, NCCL on CUDA): the step's inputs and the layers' all-reduce and
  all-gather; each operation gives up after STEP_TIMEOUT (a hung rank).
A rank that dies closes its sockets, so gloo fails the others' next operation at once;
the timeouts are only for ranks that hang. A gloo send also waits for its receiver to
post the receive, which is why rank 0's first command (sent while workers may still
be loading weights) waits up to LOAD_TIMEOUT.

The groups are built as ProcessGroupGloo / ProcessGroupNCCL objects, not through
init_process_group: no global default group, so several engines can live in one
process (tests) and a restart simply builds new groups. The NCCL path is present but
has not run (no multi-GPU machine was available); the gloo path is what was tested.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

HOST = "127.0.0.1"  # one machine: every rank is a local process
STEP_TIMEOUT = datetime.timedelta(minutes=5)
LOAD_TIMEOUT = datetime.timedelta(minutes=30)
IDLE_TIMEOUT = datetime.timedelta(days=365)
CONNECT_TIMEOUT = datetime.timedelta(minutes=2)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died (its connection closed) or hung past the timeout."""


@dataclass
class ProcessGroups:
    """One rank's two groups (see the module docstring); rank 0 also keeps the store alive."""

    rank: int
    size: int
    control: Any
    model: Any
    store: Any


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`.port`)."""
    return dist.TCPStore(HOST, 0, size, True, timeout=CONNECT_TIMEOUT, wait_for_workers=False)


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, size, False, timeout=CONNECT_TIMEOUT)


def connect(store: dist.Store, rank: int, size: int, device: torch.device) -> ProcessGroups:
    """Build this rank's groups; returns once every rank has built them (CONNECT_TIMEOUT)."""
    control = _gloo(dist.PrefixStore("control", store), rank, size)
    if device.type == "cuda":  # not run here: no multi-GPU machine
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = STEP_TIMEOUT
        model = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size, options)
    else:
        model = _gloo(dist.PrefixStore("model", store), rank, size)
    return ProcessGroups(rank, size, control, model, store)


def _gloo(store: dist.Store, rank: int, size: int) -> Any:
    # _Options: private, not in torch's stubs; the one way to set gloo's timeout and devices
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = CONNECT_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(store, rank, size, options)


class GroupCollectives:
    """All-reduce, all-gather and broadcast over a rank's current groups (models/parallel.py's
    Collectives). `groups` is replaced when rank 0 restarts its workers; the layers keep
    this object."""

    def __init__(self, groups: ProcessGroups | None = None):
        self.groups = groups

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.timeout = STEP_TIMEOUT
        _wait(self._groups().model.allreduce([tensor], options))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        groups = self._groups()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(groups.size)]
        options = AllgatherOptions()
        options.timeout = STEP_TIMEOUT
        _wait(groups.model.allgather([parts], [tensor], options))
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor, control: bool = False, timeout: datetime.timedelta | None = None) -> None:
        """Rank 0's `tensor` into every rank's, over the control group or the model group
        (waiting up to `timeout`, default STEP_TIMEOUT)."""
        groups = self._groups()
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, timeout or STEP_TIMEOUT
        _wait((groups.control if control else groups.model).broadcast([tensor], options))

    def barrier(self, timeout: datetime.timedelta) -> None:
        """Every rank has reached this point (a sum over the control group)."""
        options = dist.AllreduceOptions()
        options.timeout = timeout
        _wait(self._groups().control.allreduce([torch.ones(1)], options))

    def _groups(self) -> ProcessGroups:
        if self.groups is None:
            raise CollectiveError("the tensor-parallel process groups are closed")
        return self.groups


def _wait(work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as error:  # gloo: "Connection closed by peer", "Timed out waiting ..."
        raise CollectiveError(str(error)) from error
