"""Greedy output equals Hugging Face transformers' token for token, in one continuous batch,
under chunked prefill, prefix reuse and preemption."""

from __future__ import annotations

import pytest

from pagedserve.backend import LLMEngine, SamplingParams

from .conftest import GPU_SHARE, MAX_TOKENS, assert_engine_idle

pytestmark = pytest.mark.slow


def check_batch(engine: LLMEngine, prompts, hf_oracle, max_tokens=MAX_TOKENS):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens[: len(prompts)]]
    results = engine.generate(prompts, params, use_tqdm=False)
    references = [hf_oracle.greedy(p, n) for p, n in zip(prompts, max_tokens)]
    for prompt, result, reference in zip(prompts, results, references):
        assert result.token_ids == reference, f"prompt of {len(prompt)} tokens diverged"
    assert_engine_idle(engine)
    return results


def test_prompts_span_chat_and_raw_from_5_to_400_tokens(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and 5 <= lengths[0] <= 6 and 350 <= lengths[-1] <= 400


def test_continuous_batch_matches_transformers(engine, prompts, hf_oracle):
    results = check_batch(engine, prompts, hf_oracle)
    assert results[0].text == "The capital of France is Paris."
    assert results[0].finish_reason == "stop"


def test_chunked_prefill_matches_transformers(prompts, hf_oracle):
    engine = LLMEngine(dtype="float32", max_num_batched_tokens=32, **GPU_SHARE)
    check_batch(engine, prompts, hf_oracle)


def test_shared_prefix_hits_cache_and_matches_transformers(engine, hf_oracle, prompts):
    long_prompt = prompts[-1]
    shared = [long_prompt[:200] + engine.encode(f" Question {i}: what happened next?") for i in range(4)]
    before = engine.block_manager.prefix_hit_tokens
    results = check_batch(engine, shared, hf_oracle)
    assert engine.block_manager.prefix_hit_tokens > before
    assert max(r.num_cached_tokens for r in results) >= 192


def test_preemption_under_a_tiny_kv_cache_matches_transformers(prompts, hf_oracle):
    engine = LLMEngine(dtype="float32", num_kv_blocks=28)  # 448 token slots for ~830 tokens of work
    # longest first: it takes most blocks, the short ones squeeze in and must grow
    check_batch(engine, prompts[::-1], hf_oracle, MAX_TOKENS[::-1])
    assert engine.stats().num_preemptions > 0
