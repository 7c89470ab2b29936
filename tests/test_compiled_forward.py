"""The compiled step (backend/compiled_forward.py): greedy tokens identical to the eager
engine in every batch regime (plain, chunked prefill, shared prefix, preemption), and no
compilation after the warm-up at load. `compile: auto` compiles on CUDA only (on CPU the
eager step with packed weights is faster: benchmarks/RESULTS.md); `on` forces it here."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend import ConfigError, EngineConfig, LLMEngine, SamplingParams
from pagedserve.backend.cpu.linear_methods import OneDnnPacked, Pairs
from pagedserve.backend.models.linear import Linear

from .conftest import GPU_SHARE, assert_engine_idle, onednn_packs
from .tensor_parallel_checks import full_logits

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(small_llama):
    """An eager and a compiled engine per regime's settings, built on first use."""
    built: dict[tuple, LLMEngine] = {}

    def get(compile: str, dtype: str = "float32", **settings) -> LLMEngine:
        key = (compile, dtype, *sorted(settings.items()))
        if key not in built:
            built[key] = LLMEngine(model=small_llama, dtype=dtype, compile=compile, **{**GPU_SHARE, **settings})
        return built[key]

    return get


def run_both(engines, prompts, max_tokens, dtype: str = "float32", **settings) -> tuple[LLMEngine, list]:
    """Generate with the eager and the compiled engine; the compiled one must not compile again."""
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    eager, compiled = engines("off", dtype, **settings), engines("on", dtype, **settings)
    warmed = compiled.runner.compiled.compilations
    assert warmed > 0 and eager.runner.compiled is None
    expected = [r.token_ids for r in eager.generate(prompts, params, use_tqdm=False)]
    results = compiled.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == expected
    assert compiled.runner.compiled.compilations == warmed, "a step compiled after the warm-up"
    assert_engine_idle(compiled)
    return compiled, results


def test_plain_batch_is_token_identical_without_recompiling(engines, small_prompts):
    run_both(engines, small_prompts, [24, 16, 20, 12, 28])
    run_both(engines, small_prompts[:1], [16])  # a batch of one: the 1-row graphs


def test_chunked_prefill_is_token_identical(engines, small_prompts):
    run_both(engines, small_prompts, [24, 16, 20, 12, 28], max_num_batched_tokens=16)


def test_shared_prefix_is_token_identical_and_hits_the_cache(engines, small_prompts, sentencepiece_tokenizer):
    prefix = small_prompts[2][:64]
    shared = [prefix + sentencepiece_tokenizer.encode(f" Question {i}: what next?") for i in range(4)]
    _, results = run_both(engines, shared, [12, 16, 8, 20])
    assert max(r.num_cached_tokens for r in results) >= 48


def test_preemption_under_a_tiny_kv_cache_is_token_identical(engines, small_prompts):
    compiled, _ = run_both(engines, small_prompts[::-1], [40, 24, 40, 24, 40], num_kv_blocks=16)
    assert compiled.stats().num_preemptions > 0


def test_bfloat16_pads_rows_to_buckets_warms_every_one_and_stays_close(engines, small_prompts):
    """Half precision on CPU pads a step's rows to oneDNN's buckets; the warm-up compiled
    them all, so mixed batches of every size run without compiling. Fused bf16 kernels
    round differently from eager ones, so here logits are compared, not tokens (a random
    model's greedy margins are below bf16's resolution; float32 above is token-exact)."""
    eager, compiled = engines("off", "bfloat16", max_num_batched_tokens=64), engines("on", "bfloat16", max_num_batched_tokens=64)
    warmed = compiled.runner.compiled.compilations
    assert compiled.runner.compiled.pads_rows and compiled.runner.compiled.rows(17) == 32
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in [24, 16, 20, 12, 28]]
    compiled.generate(small_prompts, params, use_tqdm=False)
    assert compiled.runner.compiled.compilations == warmed, "a step compiled after the warm-up"
    assert_engine_idle(compiled)
    for prompt in small_prompts[1:3]:
        expected, got = full_logits(eager, prompt), full_logits(compiled, prompt)
        assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_the_bundled_model_compiled_matches_eager(prompts, engine):
    compiled = LLMEngine(dtype="float32", compile="on", **GPU_SHARE)
    eager = engine if engine.runner.compiled is None else LLMEngine(dtype="float32", compile="off", **GPU_SHARE)
    params = [SamplingParams(max_tokens=16, **GREEDY) for _ in prompts]
    expected = [r.token_ids for r in eager.generate(prompts, params, use_tqdm=False)]
    warmed = compiled.runner.compiled.compilations
    assert [r.token_ids for r in compiled.generate(prompts, params, use_tqdm=False)] == expected
    assert compiled.runner.compiled.compilations == warmed


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto compiles on CUDA (the tests above run that)")
def test_auto_runs_eagerly_on_cpu_with_packed_half_precision_weights(small_llama):
    eager = LLMEngine(model=small_llama, dtype="bfloat16")
    assert eager.runner.compiled is None
    if onednn_packs(torch.bfloat16):  # else the weights stay plain (no avx512_bf16 / avx512bw)
        # packed for oneDNN, or in pairs for the C kernel where the CPU has AVX512-BF16 (and, with AMX, the kernel its tiles)
        assert all(isinstance(m.method, (OneDnnPacked, Pairs))
                   for m in eager.runner.model.modules() if isinstance(m, Linear))


def test_compile_is_parsed_and_refused_where_it_does_not_apply():
    assert EngineConfig.from_strings({"compile": "off"}).compile == "off"
    with pytest.raises(ConfigError, match="compile"):
        EngineConfig(compile="fast")
    with pytest.raises(ConfigError, match="compile.*unquantized"):
        EngineConfig(compile="on", quantization="int4")
    assert not EngineConfig(compile="auto", quantization="int4").compile_supported
