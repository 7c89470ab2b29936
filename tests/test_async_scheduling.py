"""Async scheduling (LLMEngine.step): step k+1 is scheduled and launched before step k's
tokens are applied. Whatever the mix (chunked prefill, preemption, stop strings and stop
tokens found a step late, n > 1, seeded sampling, penalties that need every token on the
host, cancellation between steps), the outputs equal those of synchronous stepping and no
KV block leaks."""

from __future__ import annotations

import random

import pytest

from pagedserve.backend import LLMEngine, SamplingParams

from .conftest import GPU_SHARE, assert_engine_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(small_llama):
    built: dict[tuple, LLMEngine] = {}

    def get(mode: str, **settings) -> LLMEngine:
        key = (mode, *sorted(settings.items()))
        if key not in built:
            built[key] = LLMEngine(model=small_llama, dtype="float32", async_scheduling=mode,
                                   **{**GPU_SHARE, **settings})
        return built[key]

    return get


def both(engines, prompts, params, **settings):
    sync, overlapped = engines("off", **settings), engines("on", **settings)
    assert overlapped.async_scheduling and not sync.async_scheduling
    expected = sync.generate(prompts, params, use_tqdm=False)
    results = overlapped.generate(prompts, params, use_tqdm=False)
    for got, want in zip(results, expected):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert_engine_idle(overlapped)
    return overlapped, results


def test_greedy_batches_with_chunked_prefill_and_preemption(engines, small_prompts):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in [40, 5, 23, 1, 31]]
    both(engines, small_prompts, params, max_num_batched_tokens=32)
    engine, _ = both(engines, small_prompts, params, num_kv_blocks=14, max_num_batched_tokens=32)
    assert engine.stats().num_preemptions > 0


def test_stops_found_a_step_late_drop_the_extra_token(engines, small_prompts, sentencepiece_tokenizer):
    """A stop string or stop token ends a request after the next step was launched: that
    step's token for it is dropped, the output is exactly the synchronous one."""
    sync = engines("off")
    free = sync.generate(small_prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    params = []
    for i, completion in enumerate(free):
        ids = completion.token_ids
        if i % 2:  # a stop token id from the middle of the free run
            params.append(SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[ids[len(ids) // 2]]))
        else:  # a stop string from the middle of the free run's text
            text = completion.text.strip()
            stop = text[len(text) // 2 : len(text) // 2 + 3] or "e"
            params.append(SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True))
    _, results = both(engines, small_prompts, params)
    assert all(r.finish_reason == "stop" for r in results)


def test_sampling_with_seeds_n_greater_than_one_and_penalties(engines, small_prompts):
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, n=3, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True),  # needs every token
        SamplingParams(max_tokens=9, temperature=0, min_tokens=4, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True),
    ]
    both(engines, small_prompts, params)


def test_cancellation_between_steps_frees_everything(engines, small_prompts):
    """Requests aborted while a step that includes them is in flight: the others finish as
    they would have, and every block comes back."""
    rng = random.Random(0)
    engine = engines("on", max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = {i: r.token_ids for i, r in enumerate(engines("off").generate(small_prompts, params, use_tqdm=False))}
    ids = {engine.add_request(p, params): i for i, p in enumerate(small_prompts)}
    cancelled = set(rng.sample(sorted(ids), 2))
    got: dict[str, list[int]] = {r: [] for r in ids}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] += output.new_token_ids
        steps += 1
        if steps == 6:
            for request_id in cancelled:
                engine.abort(request_id)
    for request_id, index in ids.items():
        if request_id not in cancelled:
            assert got[request_id] == expected[index]
    assert_engine_idle(engine)
