"""Greedy output equals Hugging Face transformers' token for token, in one continuous batch,
under chunked prefill, prefix reuse and preemption."""

from __future__ import annotations

import pytest
import torch

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


def test_deterministic_bf16_without_the_c_matmul_is_refused_naming_the_fix(monkeypatch):
    """Without a C compiler bf16 layers would go to oneDNN, whose kernels sum a row in another
    order at other row counts (AMX): `deterministic` could not keep its promise, so it is refused."""
    from pagedserve.backend.errors import ConfigError
    from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu

    monkeypatch.setattr(bf16_matmul_cpu.LIBRARY, "get", lambda: None)
    with pytest.raises(ConfigError, match="deterministic.*C compiler.*dtype=float32"):
        LLMEngine(dtype="bfloat16", deterministic=True, device="cpu", num_kv_blocks=64)


@pytest.mark.bit_exact("engine")
@pytest.mark.parametrize("model, dtype", [("bundled", "bfloat16"), ("bundled", "float32"), ("random llama", "float32")])
def test_deterministic_greedy_is_the_same_alone_and_beside_others(model, dtype, request):
    """`deterministic`: one request's greedy tokens and their logprobs, bit for bit, alone
    and beside five others of other lengths whose prefill chunks share its steps (the bundled
    model in half precision gave other tokens from the 45th without it; a float32 checkpoint
    that is not GGUF-exact multiplies a few rows through the C GEMV by default). A second target,
    100 random token ids (a flat distribution, where the last bits decide), is cut into other
    prefill chunks alone (64 + 36) than beside the others: with AMX, oneDNN's bf16 GEMMs gave its
    first token another logprob. On a GPU the same check runs the batch-invariant Triton launches
    (tests/test_batch_invariant.py on CPU)."""
    if model == "bundled":
        engine_prompts, path = request.getfixturevalue("prompts"), ""
    else:
        engine_prompts, path = request.getfixturevalue("small_prompts"), request.getfixturevalue("small_llama")
    engine = LLMEngine(model=path, dtype=dtype, deterministic=True, enable_prefix_caching=False,
                       max_num_batched_tokens=64, **GPU_SHARE)
    others = [p for p in engine_prompts if p is not engine_prompts[1]][:5]
    flat = torch.randint(100, engine.model_config.vocab_size, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=0)
    for target in (engine_prompts[1], flat):
        alone, = engine.generate([target], params, use_tqdm=False)
        beside = engine.generate([others[0], target, *others[1:]], params, use_tqdm=False)[1]
        assert beside.token_ids == alone.token_ids
        assert [p.logprob for p in beside.logprobs] == [p.logprob for p in alone.logprobs]
    assert_engine_idle(engine)
