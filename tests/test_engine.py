"""LLMEngine API: requests, stop conditions, seeds, logprobs, aborts, limits."""

from __future__ import annotations

import pytest

from pagedserve.backend import InvalidRequestError, LLMEngine, QueueFullError, SamplingParams
from pagedserve.backend.model_files import DEFAULT_SAMPLING

from .conftest import GPU_SHARE, assert_engine_idle

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_max_tokens_ends_with_length(engine):
    [result] = engine.generate(["Once upon a time"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert_engine_idle(engine)


def test_a_request_without_sampling_parameters_takes_the_checkpoints_generation_config(engine, monkeypatch):
    """vLLM's LLM.get_default_sampling_params: the bundled model's card's recommendation (its GGUF has
    no generation_config.json), a checkpoint's generation_config.json where it sets one, vLLM's own
    defaults where it sets nothing."""
    defaults = engine.default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (DEFAULT_SAMPLING["temperature"], DEFAULT_SAMPLING["top_p"])
    monkeypatch.setattr(engine.model_config, "generation_defaults", {"temperature": 0.6, "top_p": 0.9})
    defaults = engine.default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, SamplingParams().max_tokens)
    monkeypatch.setattr(engine.model_config, "generation_defaults", {})
    assert engine.default_sampling_params() == SamplingParams()


def test_chat_answers_a_conversation_or_several(engine):
    """vLLM's LLM.chat: messages rendered with the model's chat template (a raw prompt of the same
    question gets the instruct model's end token), one conversation or a list of them."""
    greedy = SamplingParams(max_tokens=16, temperature=0)
    [one] = engine.chat(CAPITAL, greedy, use_tqdm=False)
    assert "Paris" in one.text
    assert [c.text for c in engine.chat([CAPITAL, CAPITAL], greedy, use_tqdm=False)] == [one.text, one.text]


def test_chat_template_kwargs_reach_the_template_from_the_python_api(engine):
    """vLLM's LLM.chat(..., chat_template_kwargs=...): the template's own variables (this model's
    template reads none, so the ids stay), and the server's own arguments refused by name."""
    assert engine.encode(messages=CAPITAL, chat_template_kwargs={"enable_thinking": False}) == engine.encode(messages=CAPITAL)
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        engine.encode(messages=CAPITAL, chat_template_kwargs={"add_generation_prompt": False})


def test_ignore_eos_and_min_tokens_run_past_the_end(engine):
    ids = engine.encode(messages=CAPITAL)
    [plain] = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in engine.model_config.eos_token_ids
    [forced] = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(forced.token_ids) == 30 and forced.finish_reason == "length"
    [minimum] = engine.generate([ids], SamplingParams(max_tokens=30, min_tokens=12, temperature=0), use_tqdm=False)
    assert len(minimum.token_ids) >= 12


def test_stop_string_and_stop_token_ids(engine):
    ids = engine.encode(messages=CAPITAL)
    [cut] = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, stop=["is P"]), use_tqdm=False)
    assert cut.text == "The capital of France " and cut.finish_reason == "stop"
    paris = engine.encode(" Paris")[-1]
    [by_id] = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[paris]), use_tqdm=False)
    assert by_id.token_ids[-1] == paris and by_id.finish_reason == "stop"
    assert_engine_idle(engine)


def test_same_seed_same_text_different_seed_differs(engine):
    prompt = "Write a short poem about rain:"
    def sample(seed, mates=0):
        params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed)
        batch = [prompt] + ["Tell me about cats."] * mates
        others = [SamplingParams(max_tokens=8, temperature=1.0)] * mates
        return engine.generate(batch, [params] + others, use_tqdm=False)[0].text
    first = sample(7)
    assert sample(7, mates=3) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_logprobs_and_cumulative_logprob(engine):
    [result] = engine.generate(["The sky is"], SamplingParams(max_tokens=4, temperature=0, logprobs=2), use_tqdm=False)
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    assert all(lp.top[0][0] == lp.token_id and len(lp.top) == 2 for lp in result.logprobs)  # greedy = top-1
    assert result.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in result.logprobs))


def test_abort_frees_blocks_and_reports_abort(engine):
    engine.add_request("Count slowly to one hundred:", SamplingParams(max_tokens=200, ignore_eos=True), request_id="x")
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    final = engine.abort("x")
    assert final.finished and final.finish_reason == "abort"
    assert engine.abort("x") is None
    assert_engine_idle(engine)


def test_invalid_requests_name_the_field(engine):
    with pytest.raises(InvalidRequestError, match="'prompt'.*empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="'prompt'.*tokens; the limit is"):
        engine.add_request([1] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="'input_ids'.*outside the vocabulary"):
        engine.add_request([1, 10**7], SamplingParams())
    assert_engine_idle(engine)


def test_queue_bound_says_busy(model_path):
    small = LLMEngine(dtype="float32", max_queue_size=2, max_num_seqs=1, **GPU_SHARE)
    for prompt in ("a", "b", "c"):  # one runs, two wait
        small.add_request(prompt)
    with pytest.raises(QueueFullError, match="retry later"):
        small.add_request("d")


def test_prompt_logprobs_give_the_same_perplexity_as_transformers(engine, hf_oracle, prompts):
    import math

    import torch

    ids = prompts[-1]
    ours = engine.prompt_logprobs(ids)
    with torch.inference_mode():
        loss = hf_oracle.model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert len(ours) == len(ids) - 1
    assert math.exp(-sum(ours) / len(ours)) == pytest.approx(math.exp(loss), rel=1e-4)
    assert_engine_idle(engine)


def test_bad_words_never_appear_in_the_output(engine):
    ids = engine.encode(messages=CAPITAL)
    [plain] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert "Paris" in plain.text
    [banned] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0, bad_words=["Paris"]), use_tqdm=False)
    assert "Paris" not in banned.text and banned.text != plain.text
    assert_engine_idle(engine)


def test_n_samples_share_the_prompt_blocks_and_each_decodes_on_its_own(engine):
    ids = engine.encode(messages=CAPITAL)  # several full blocks of prompt
    assert len(ids) > 2 * engine.config.block_size
    [single] = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    hits_before = engine.block_manager.prefix_hit_tokens
    [greedy] = engine.generate([ids], SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [s.token_ids for s in greedy.samples] == [single.token_ids] * 3
    assert [s.text for s in greedy.samples] == [single.text] * 3
    shared = (len(ids) - 1) // engine.config.block_size * engine.config.block_size
    assert [s.num_cached_tokens >= shared for s in greedy.samples[1:]] == [True, True]
    assert engine.block_manager.prefix_hit_tokens - hits_before >= 2 * shared
    sampled = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    [first] = engine.generate([ids], sampled, use_tqdm=False)
    [again] = engine.generate([ids], sampled, use_tqdm=False)
    assert len({tuple(s.token_ids) for s in first.samples}) == 3  # each sample its own draw
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]  # seeded: repeatable
    assert_engine_idle(engine)


def test_n_samples_stream_one_output_per_step_and_abort_together(engine):
    request_id = engine.add_request("Count to fifty:", SamplingParams(n=2, max_tokens=40, ignore_eos=True))
    outputs = []
    while len(outputs) < 4:
        outputs += engine.step()
    assert all(o.request_id == request_id and [s.index for s in o.samples] == [0, 1] for o in outputs)
    final = engine.abort(request_id)
    assert final.finished and [s.finish_reason for s in final.samples] == ["abort", "abort"]
    assert not engine.has_unfinished_requests()
    assert_engine_idle(engine)


def stream(engine, prompt, params):
    """Every output of one request, stepping the engine until it finishes."""
    engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_stream_interval_gathers_tokens_per_output_with_the_same_text(engine, monkeypatch):
    params = dict(max_tokens=10, temperature=0, ignore_eos=True)
    every = stream(engine, "Count to ten:", SamplingParams(**params))
    asked = stream(engine, "Count to ten:", SamplingParams(**params, stream_interval=4))
    assert [len(o.new_token_ids) for o in every] == [1] * 10
    assert [len(o.new_token_ids) for o in asked] == [1, 4, 4, 1]
    assert "".join(o.text for o in asked) == "".join(o.text for o in every)
    monkeypatch.setattr(engine.config, "stream_interval", 3)  # the engine's setting; a request may only raise it
    assert [len(o.new_token_ids) for o in stream(engine, "Count to ten:", SamplingParams(**params, stream_interval=2))] == [1, 3, 3, 3]
    assert_engine_idle(engine)


def test_generate_renders_once_at_the_end_with_the_streamed_text(engine, prompts):
    """`generate` wants finished outputs alone, so its requests render their text once at
    the end (no per-step deltas); the result equals the deltas of the same requests streamed
    step by step, stop strings (which need the text as it grows), n > 1 and logprobs included."""
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, stop=[" the"], ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, logprobs=2),
    ]
    chosen = prompts[:4]
    finals = engine.generate(chosen, params, use_tqdm=False)
    streamed: dict[str, list] = {}
    ids = [engine.add_request(p, q) for p, q in zip(chosen, params)]
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed.setdefault(output.request_id, []).append(output)
    for request_id, final in zip(ids, finals):
        outputs = streamed[request_id]
        for index, sample in enumerate(final.samples or [final]):
            deltas = [s for o in outputs for s in o.per_sample() if s.index == index]
            assert sample.text == "".join(d.text for d in deltas)
            assert sample.token_ids == [t for d in deltas for t in d.new_token_ids]
    assert len(finals[3].logprobs) == len(finals[3].token_ids)
    assert_engine_idle(engine)


def test_a_huge_top_k_is_refused_or_clamped_and_never_fails_the_step(engine):
    """top_k past what a tensor holds is refused naming the field; past the vocabulary it
    keeps every token. Either way a greedy request beside it gets the tokens it gets alone."""
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=10**20, top_p=0.9)
    bystander = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate(["The capital of France is"], bystander, use_tqdm=False)[0].token_ids
    wide = SamplingParams(max_tokens=12, temperature=1.0, top_k=10**9, top_p=0.9, seed=1, ignore_eos=True)
    results = engine.generate(["The capital of France is", "Once upon a time"], [bystander, wide], use_tqdm=False)
    assert results[0].token_ids == alone and len(results[1].token_ids) == 12
    assert_engine_idle(engine)


def test_stop_strings_and_bad_words_are_capped_by_the_configuration(engine):
    """Every stop string is searched after every token and every bad word checked at every
    step, on the engine's thread that all requests share: the counts and lengths a request
    may give are capped (EngineConfig), and past a cap the error names the field and the knob."""
    config = engine.config
    ok = SamplingParams(max_tokens=4, stop=["x" * config.max_stop_chars] * config.max_stop_strings)
    engine.check_admission([1, 2, 3], ok)
    for params, field, knob in [
        (SamplingParams(stop=["a"] * (config.max_stop_strings + 1)), "stop", "max_stop_strings"),
        (SamplingParams(stop=["a" * (config.max_stop_chars + 1)]), "stop", "max_stop_chars"),
        (SamplingParams(bad_words=["w"] * (config.max_bad_words + 1)), "bad_words", "max_bad_words"),
    ]:
        with pytest.raises(InvalidRequestError, match=knob) as caught:
            engine.add_request([1, 2, 3], params)
        assert caught.value.field == field
    at_cap = SamplingParams(max_tokens=1, bad_words=[f"w{i}" for i in range(config.max_bad_words)])
    engine.generate([[1, 2, 3]], at_cap, use_tqdm=False)  # counted as given, not as the ids its words become
    assert_engine_idle(engine)
