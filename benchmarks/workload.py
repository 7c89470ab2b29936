"""The fixed, seeded offline workload shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import random
import re
from dataclasses import dataclass

import torch

from pagedserve.backend.device import cpuinfo, native_bf16_flags


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


def machine() -> str:
    """The machine line every benchmark prints beside its numbers (they differ up to 4x)."""
    text = cpuinfo()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = set(re.findall(r"\b(avx512_bf16|amx_bf16|amx_tile|amx_int8|avx512_fp16)\b", text))
    return (f"Machine: {model.group(1) if model else platform.processor()}, {os.cpu_count()} cores, native bf16: "
            f"{' '.join(native_bf16_flags(text)) or 'none'}; flags seen: {' '.join(sorted(flags)) or 'none'}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}.")



def single_stream(vocab_size: int) -> WorkItem:
    """The request timed alone (benchmarks/single_stream.py): a 128-token prompt, 65 tokens out."""
    rng = random.Random(1)
    return WorkItem([rng.randrange(100, vocab_size) for _ in range(128)], 65)
