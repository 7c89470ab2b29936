"""The fixed, seeded offline workload shared by the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


def offline_workload(
    vocab_size: int,
    num_requests: int = 64,
    prompt_range: tuple[int, int] = (30, 300),
    output_range: tuple[int, int] = (16, 256),
    seed: int = 0,
    first_id: int = 100,
) -> list[WorkItem]:
    """Random-token prompts (ids from first_id up, skipping special tokens) and output lengths."""
    rng = random.Random(seed)
    return [
        WorkItem(
            prompt_token_ids=[rng.randrange(first_id, vocab_size) for _ in range(rng.randint(*prompt_range))],
            output_len=rng.randint(*output_range),
        )
        for _ in range(num_requests)
    ]
