"""Sequence: the per-request state the scheduler, KV manager and runner share."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the client or the server


@dataclass
class TokenLogprob:
    """Logprob of a sampled token, with the top alternatives when asked."""

    token_id: int
    logprob: float
    rank: int = 1
    """1 + the number of tokens more likely than this one."""
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)

    token_ids: list[int] = field(init=False)
    """Prompt followed by the generated tokens."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache or being written by a step scheduled already
    (prefix hits included): the scheduler counts a step's tokens when it schedules them."""
    num_pending_tokens: int = 0
    """Tokens sampled by a scheduled step whose ids have not reached the host yet (at most
    one beyond the step being processed, with async scheduling): they count in num_tokens,
    not in token_ids."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when last admitted."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of this sequence's full blocks, in order."""
    num_named_blocks: int = 0
    """Leading blocks of block_table the block manager has named (or found named) already."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    sample_index: int = 0
    """Which of the request's n samples this is."""
    fork_of: "Sequence | None" = None
    """The sample whose prompt blocks this one shares (n > 1)."""
    grammar: Any = None
    """Its structured output's matcher (xgrammar), made when the engine starts it."""
    mm: Any = None
    """Its prompt's images (a multimodal.MultiModalPrompt), None for text."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens so far, the pending ones included (what the scheduler plans with)."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose ids are known (pending ones not counted)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def reaches_limit(self, max_model_len: int | None) -> bool:
        """Its pending tokens end it by length (max_tokens or max_model_len): no step more."""
        outputs = self.num_tokens - self.num_prompt_tokens
        return outputs >= self.params.max_tokens or (max_model_len is not None and self.num_tokens >= max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
