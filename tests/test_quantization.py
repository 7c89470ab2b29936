"""End to end on CPU: quantized weights (INT4, FP8), an FP8 KV cache, and the Triton
attention kernels (through the interpreter) still answer correctly and keep perplexity
within bounds of the unquantized model."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams

from .conftest import CHAT, GPU_SHARE, LONG_TEXT, assert_engine_idle

pytestmark = pytest.mark.slow

CAPITAL = CHAT[0]


def perplexity(engine: LLMEngine) -> float:
    logprobs = engine.prompt_logprobs(engine.encode(LONG_TEXT))
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def baseline_perplexity(engine) -> float:
    return perplexity(engine)


@pytest.mark.parametrize(
    "settings,bound",
    [
        ({"quantization": "int4"}, 0.05),
        ({"quantization": "fp8"}, 0.02),
        # the attention implementation moves it by half a point (measured: +1.6% the torch
        # reference, +1.9% the CPU attention, +2.1% the Triton kernels on an H200); the CPU
        # layouts were chosen to keep 2% (benchmarks/RESULTS.md)
        ({"kv_cache_dtype": "fp8"}, 0.025 if torch.cuda.is_available() else 0.02),
    ],
    ids=["int4", "fp8", "fp8-kv"],
)
def test_quantized_engine_answers_paris_and_keeps_perplexity(settings, bound, baseline_perplexity):
    engine = LLMEngine(dtype="float32", **GPU_SHARE, **settings)
    [answer] = engine.generate([engine.encode(messages=CAPITAL)], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert "Paris" in answer.text
    ratio = perplexity(engine) / baseline_perplexity
    assert ratio - 1 <= bound, f"perplexity {ratio - 1:+.1%} over the unquantized model"
    assert_engine_idle(engine)


def test_triton_attention_through_the_interpreter_matches_the_torch_path(engine):
    """Mixed batch: a chunked prefill and decodes; both KV dtypes."""
    prompts = [engine.encode(messages=CAPITAL), "The capital of Italy is"]
    params = SamplingParams(max_tokens=4, temperature=0)
    expected = [r.token_ids for r in engine.generate(prompts, params, use_tqdm=False)]
    triton_engine = LLMEngine(dtype="float32", attention_backend="triton", max_num_batched_tokens=32, **GPU_SHARE)
    assert [r.token_ids for r in triton_engine.generate(prompts, params, use_tqdm=False)] == expected
    assert_engine_idle(triton_engine)
