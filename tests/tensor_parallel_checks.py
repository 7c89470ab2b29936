"""Shared by the tensor-parallel tests (tests/test_distributed.py, tests/integration/
test_tensor_parallel_served.py): a small Llama whose shapes split over 2 ranks, the
live worker processes, and the reason greedy tokens can be compared exactly.

Why exact token identity holds: sharding changes only the order of float32 sums (the
row-parallel all-reduce adds two half-sums; embedding and LM-head collectives are
exact). That moves a logit by ~1e-6 here. If two runs' logits differ by at most d
everywhere and the chosen token leads the runner-up by more than 2d, both runs choose
it. `greedy_margins` measures both numbers so a test can check that premise instead
of hoping.
"""

from __future__ import annotations

import os

import psutil
import torch

from pagedserve.backend import LLMEngine
from pagedserve.backend.distributed.workers import WORKER_MODULE

SMALL_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=512, initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def write_small_llama(directory: str | os.PathLike, tokenizer, num_kv_heads: int = 2, tie_word_embeddings: bool = False) -> str:
    """A random 2-layer Llama (4 heads, `num_kv_heads` KV heads, vocabulary rounded up to
    a multiple of 64) with `tokenizer`, saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = -(-len(tokenizer) // 64) * 64
    config = LlamaConfig(**SMALL_LLAMA, num_key_value_heads=num_kv_heads, vocab_size=vocab,
                         tie_word_embeddings=tie_word_embeddings)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def worker_processes(parent: psutil.Process | None = None) -> list[psutil.Process]:
    """Live tensor-parallel worker processes below `parent` (default: this process)."""
    parent = parent or psutil.Process()
    found = []
    for child in parent.children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def full_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Logits after every token of `token_ids` (one prefill on borrowed blocks)."""
    with engine.scheduler.borrowed_blocks(len(token_ids)) as block_table:
        return engine.runner.run_prefill(token_ids, block_table)


def greedy_margins(reference: LLMEngine, other: LLMEngine, sequences: list[tuple[list[int], int]]) -> tuple[float, float]:
    """(largest |logit difference| between the engines, smallest lead of the greedy token
    over the runner-up in `reference`) over the generated positions of each
    (prompt + output tokens, number of output tokens)."""
    largest_difference, smallest_lead = 0.0, float("inf")
    for token_ids, num_generated in sequences:
        rows = slice(len(token_ids) - num_generated - 1, len(token_ids) - 1)
        a, b = full_logits(reference, token_ids)[rows], full_logits(other, token_ids)[rows]
        largest_difference = max(largest_difference, (a - b).abs().max().item())
        top2 = a.topk(2, dim=-1).values
        smallest_lead = min(smallest_lead, (top2[:, 0] - top2[:, 1]).min().item())
    return largest_difference, smallest_lead
