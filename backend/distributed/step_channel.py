"""Rank 0 -> workers: what to do next, as flat tensors (no pickled Python objects).

A header (int64 [8], control group) carries the command and, for a step, the sizes
that cut the payload plus the two maxima attention needs. The payload (one int64
tensor, model group) is the step's flat inputs concatenated: input ids, positions,
slot mapping, block tables (flattened), seq lens, query start offsets, logits indices.
Rank 0 keeps the scheduler and block manager: the workers see only block tables,
identical for every rank since each holds the same blocks of its own KV heads.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass

import torch

from ..attention import AttentionMetadata
from ..model_runner import ModelInputs
from .group import IDLE_TIMEOUT, GroupCollectives

HEADER_SIZE = 8


class Command(enum.IntEnum):
    STEP = 1
    INIT = 2
    """Allocate the KV cache; the header's `arg` is the number of blocks."""
    SHUTDOWN = 3


@dataclass
class Message:
    """What a worker received: a command, its argument, and a step's inputs."""

    command: Command
    arg: int = 0
    inputs: ModelInputs | None = None


class StepChannel:
    def __init__(self, collectives: GroupCollectives, device: torch.device):
        self.collectives = collectives
        self.device = device

    # -- rank 0 ------------------------------------------------------------------
    def send_command(self, command: Command, arg: int = 0, timeout: datetime.timedelta | None = None) -> None:
        self._send_header([command, 0, 0, 0, 0, 0, 0, arg], timeout)

    def send_step(self, inputs: ModelInputs) -> None:
        meta = inputs.meta
        num_seqs, max_blocks = meta.block_tables.shape
        self._send_header(
            [Command.STEP, len(inputs.input_ids), num_seqs, max_blocks, len(inputs.logits_indices),
             meta.max_query_len, meta.max_seq_len, 0],
            None,
        )
        parts = (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                 meta.query_start_loc, inputs.logits_indices)
        self.collectives.broadcast(torch.cat([p.reshape(-1).to(torch.int64) for p in parts]))

    def _send_header(self, values: list[int], timeout: datetime.timedelta | None) -> None:
        self.collectives.broadcast(torch.tensor(values, dtype=torch.int64), control=True, timeout=timeout)

    # -- workers -----------------------------------------------------------------
    def receive(self) -> Message:
        """Wait (as long as the engine stays idle) for rank 0's next command."""
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        self.collectives.broadcast(header, control=True, timeout=IDLE_TIMEOUT)
        command, num_tokens, num_seqs, max_blocks, num_logits, max_query_len, max_seq_len, arg = header.tolist()
        if command != Command.STEP:
            return Message(Command(command), arg)
        sizes = [num_tokens, num_tokens, num_tokens, num_seqs * max_blocks, num_seqs, num_seqs + 1, num_logits]
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        self.collectives.broadcast(payload)
        input_ids, positions, slots, tables, seq_lens, query_start, logits_indices = payload.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=query_start.to(torch.int32),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        inputs = ModelInputs(input_ids, positions, meta, logits_indices, sampling_seqs=[])
        return Message(Command.STEP, inputs=inputs)
