"""Speculative decoding (n-gram) on the bundled model in float32: greedy tokens, text, stops,
lengths and logprobs equal to speculation off, in one batch beside prefill chunks, under
preemption and in streaming; seeded sampled requests equal to speculation off and the sampled
distribution the model's (chi-square); LoRA requests; adaptive draft lengths; and the
speculation is not vacuous (drafts are accepted)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams

from .conftest import GPU_SHARE, MAX_TOKENS, assert_engine_idle

pytestmark = pytest.mark.slow

SPEC = "method=ngram,num_speculative_tokens=4,prompt_lookup_min=1,prompt_lookup_max=3,draft_length=fixed"
REPEAT = ("apple banana cherry date elderberry fig grape\n" * 3) + "apple banana"


@pytest.fixture(scope="module")
def spec_engine() -> LLMEngine:
    """Speculation on, a small token budget: prompts are chunked beside the verifies."""
    return LLMEngine(dtype="float32", speculative_config=SPEC, max_num_batched_tokens=32, **GPU_SHARE)


@pytest.fixture(scope="module")
def repeat(engine) -> list[int]:
    return engine.encode(REPEAT)


def greedy(n, **params):
    return SamplingParams(max_tokens=n, temperature=0.0, **params)


def record_steps(engine, monkeypatch) -> list[tuple[str, int]]:
    """(request id, tokens given) of every sampling sequence of every step, as update_from_output sees them."""
    steps: list[tuple[str, int]] = []
    update = engine.scheduler.update_from_output

    def recording(batch, token_ids, *args, **kwargs):
        for seq, entry in zip(batch.sampling_seqs, token_ids):
            steps.append((seq.request_id, 1 if isinstance(entry, int) else len(entry)))
        return update(batch, token_ids, *args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "update_from_output", recording)
    return steps


def test_greedy_batch_equals_speculation_off_with_drafts_accepted(engine, spec_engine, prompts, repeat, monkeypatch):
    batch = [repeat] + prompts
    params = [greedy(40, ignore_eos=True)] + [greedy(n) for n in MAX_TOKENS]
    before = spec_engine.stats().spec_num_accepted_tokens
    mixed = []  # steps holding a verify beside a prompt chunk
    schedule = spec_engine.scheduler.schedule

    def recording():
        scheduled = schedule()
        chunks = any(not samples for samples in scheduled.samples)
        mixed.append(scheduled.has_drafts and chunks)
        return scheduled

    monkeypatch.setattr(spec_engine.scheduler, "schedule", recording)
    off = engine.generate(batch, params, use_tqdm=False)
    on = spec_engine.generate(batch, params, use_tqdm=False)
    assert any(mixed), "no step verified drafts beside a prefill chunk"
    for a, b in zip(off, on):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    stats = spec_engine.stats()
    assert stats.spec_num_accepted_tokens - before >= 10, "the repetitive prompt should accept drafts"
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.spec_num_draft_tokens <= 4 * stats.spec_num_drafts
    assert all(x >= y for x, y in zip(stats.spec_accepted_per_pos, stats.spec_accepted_per_pos[1:]))
    assert_engine_idle(spec_engine)
    # the KV of accepted tokens is cached and right: the whole text again as a prompt hits it
    again = repeat + on[0].token_ids
    off_again = engine.generate([again], greedy(12), use_tqdm=False)
    on_again = spec_engine.generate([again], greedy(12), use_tqdm=False)
    assert on_again[0].num_cached_tokens >= 48 and on_again[0].token_ids == off_again[0].token_ids
    assert_engine_idle(spec_engine)


def test_stop_token_and_stop_string_inside_an_accepted_run(engine, spec_engine, repeat, monkeypatch):
    steps = record_steps(spec_engine, monkeypatch)
    base = spec_engine.generate([repeat], greedy(30, ignore_eos=True), use_tqdm=False)[0]
    assert base.token_ids == engine.generate([repeat], greedy(30, ignore_eos=True), use_tqdm=False)[0].token_ids
    runs, end = [], 0  # (first output index, tokens) of each step
    for _, count in steps:
        runs.append((end, count))
        end += count
    out = base.token_ids
    inside = [start + j for start, count in runs if count >= 3 for j in range(1, count - 1)]
    assert inside, f"no step accepted two drafts: {runs}"
    position = next((p for p in inside if out[p] not in out[:p]), None)
    assert position is not None, "no token is first met inside an accepted run"
    params = greedy(30, stop_token_ids=[out[position]])  # a stop token id first met in the middle of a run
    a = engine.generate([repeat], params, use_tqdm=False)[0]
    b = spec_engine.generate([repeat], params, use_tqdm=False)[0]
    assert len(b.token_ids) == position + 1 and b.finish_reason == "stop"
    assert (b.token_ids, b.text) == (a.token_ids, a.text)
    # a stop string whose first occurrence ends in the text of the token at `position`
    position = inside[0]
    before = engine.generate([repeat], greedy(position, ignore_eos=True), use_tqdm=False)[0].text
    through = engine.generate([repeat], greedy(position + 1, ignore_eos=True), use_tqdm=False)[0].text
    stop = next(through[-n:] for n in range(1, len(through) + 1)
                if through.find(through[-n:]) + n > len(before))
    for include in (False, True):
        params = greedy(30, stop=[stop], include_stop_str_in_output=include, ignore_eos=True)
        a = engine.generate([repeat], params, use_tqdm=False)[0]
        b = spec_engine.generate([repeat], params, use_tqdm=False)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, "stop")
        assert len(b.token_ids) == position + 1
    assert_engine_idle(spec_engine)


def test_max_tokens_sweep_gives_exactly_max_tokens(engine, spec_engine, repeat, prompts):
    batch = [repeat] * 12 + [prompts[1]] * 12
    params = [greedy(n, ignore_eos=True) for n in range(1, 13)] * 2
    full = [engine.generate([p], greedy(12, ignore_eos=True), use_tqdm=False)[0].token_ids for p in (repeat, prompts[1])]
    results = spec_engine.generate(batch, params, use_tqdm=False)
    for index, result in enumerate(results):
        n = index % 12 + 1
        assert result.token_ids == full[index // 12][:n] and result.finish_reason == "length"
    assert_engine_idle(spec_engine)


def test_logprobs_for_every_token_equal_speculation_off(engine, spec_engine, repeat, prompts):
    params = greedy(24, logprobs=2, ignore_eos=True)
    off = engine.generate([repeat, prompts[0]], params, use_tqdm=False)
    on = spec_engine.generate([repeat, prompts[0]], params, use_tqdm=False)
    for a, b in zip(off, on):
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(b.token_ids) == 24
        for x, y in zip(a.logprobs, b.logprobs):
            assert (y.token_id, y.rank, [t for t, _ in y.top]) == (x.token_id, x.rank, [t for t, _ in x.top])
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def test_streamed_deltas_concatenate_to_the_final_text_beside_a_sampled_request(engine, spec_engine, repeat):
    for interval in (1, 3):
        params = greedy(30, ignore_eos=True, stream_interval=interval)
        final = engine.generate([repeat], params, use_tqdm=False)[0]
        request_id = spec_engine.add_request(repeat, params)
        spec_engine.add_request("Tell me a story.", SamplingParams(max_tokens=20, temperature=0.8, seed=3))
        outputs = []
        while spec_engine.has_unfinished_requests():
            outputs += [o for o in spec_engine.step() if o.request_id == request_id]
        assert "".join(o.text for o in outputs) == final.text
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert_engine_idle(spec_engine)


def test_preemption_under_a_tiny_kv_cache_equals_speculation_off(engine, prompts, repeat):
    spec = LLMEngine(dtype="float32", num_kv_blocks=28, speculative_config=SPEC)
    batch = prompts[::-1] + [repeat]
    params = [greedy(n) for n in MAX_TOKENS[::-1]] + [greedy(40, ignore_eos=True)]
    off = engine.generate(batch, params, use_tqdm=False)
    on = spec.generate(batch, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = spec.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert_engine_idle(spec)


def test_deterministic_greedy_equals_speculation_off(engine, repeat, prompts):
    spec = LLMEngine(dtype="float32", deterministic=True, speculative_config=SPEC, max_num_batched_tokens=32, **GPU_SHARE)
    plain = LLMEngine(dtype="float32", deterministic=True, **GPU_SHARE)
    batch, params = [repeat, prompts[2], prompts[5]], greedy(24, ignore_eos=True)
    on = spec.generate(batch, params, use_tqdm=False)
    off = plain.generate(batch, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert spec.stats().spec_num_accepted_tokens > 0
    assert_engine_idle(spec)


def test_n_greedy_samples_equal_speculation_off(engine, spec_engine, repeat):
    params = SamplingParams(max_tokens=20, temperature=0.0, n=2, ignore_eos=True)
    off = engine.generate([repeat], params, use_tqdm=False)[0]
    on = spec_engine.generate([repeat], params, use_tqdm=False)[0]
    assert [s.token_ids for s in on.samples] == [s.token_ids for s in off.samples]
    assert len(on.samples) == 2 and on.samples[0].token_ids == on.samples[1].token_ids
    assert_engine_idle(spec_engine)


# -- sampled requests ------------------------------------------------------------------------
def test_seeded_sampled_requests_equal_speculation_off_token_for_token(engine, spec_engine, repeat, prompts):
    """A sampled row races with its own noise in row order and a rejected row's draws are drawn
    again for the tokens after it, so a seed gives the same text with speculation as without."""
    batch = [repeat, repeat, prompts[1], prompts[4]]
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, top_k=20, seed=12, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, min_p=0.05, seed=13),
              greedy(24)]
    before = spec_engine.stats()
    off = engine.generate(batch, params, use_tqdm=False)
    on = spec_engine.generate(batch, params, use_tqdm=False)
    for a, b in zip(off, on):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert [x.logprob for x in on[0].logprobs] == pytest.approx([x.logprob for x in off[0].logprobs], abs=1e-4)
    after = spec_engine.stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    rejected = after.spec_num_draft_tokens - before.spec_num_draft_tokens - accepted
    assert accepted >= 10 and rejected > 0, (accepted, rejected)
    two = SamplingParams(max_tokens=30, temperature=0.8, n=2, seed=5, ignore_eos=True)
    assert ([s.token_ids for s in spec_engine.generate([repeat], two, use_tqdm=False)[0].samples]
            == [s.token_ids for s in engine.generate([repeat], two, use_tqdm=False)[0].samples])
    assert_engine_idle(spec_engine)


def test_sampled_tokens_follow_the_targets_distribution_under_any_drafts(small_llama, monkeypatch):
    """A chi-square test over the 27 first three tokens of a random model sampled with
    top_k=3 (the target's probabilities read from its own logprobs without speculation), while a
    proposer drafts at random among the likely tokens and one impossible token, so drafts are
    accepted, partly accepted and rejected. The engine's seed is fixed: the outcome is the same
    on every run; a correct verifier fails it with probability 1e-3."""
    k, n = 3, 3000
    plain = LLMEngine(model=small_llama, dtype="float32", max_num_seqs=256, **GPU_SHARE)
    prompt = list(range(40, 52))

    def top(prefixes):
        """Each prefix's top-k next tokens and their probabilities under top_k = k, temperature 1."""
        outs = plain.generate([prompt + list(p) for p in prefixes], greedy(1, logprobs=k), use_tqdm=False)
        tables = []
        for out in outs:
            ids, logprobs = zip(*out.logprobs[0].top)
            weights = torch.tensor(logprobs, dtype=torch.float64).softmax(0).tolist()
            tables.append(dict(zip(ids, weights)))
        return dict(zip(prefixes, tables))

    first = top([()])
    second = top([(a,) for a in first[()]])
    third = top([(a, b) for (a,) in second for b in second[(a,)]])
    table = {**first, **second, **third}
    expected = {(a, b, c): first[()][a] * second[(a,)][b] * third[(a, b)][c]
                for (a, b), nexts in third.items() for c in nexts}

    spec = LLMEngine(model=small_llama, dtype="float32", max_num_seqs=256, speculative_config="num_speculative_tokens=2",
                     max_queue_size=n, **GPU_SHARE)
    rng = random.Random(0)
    impossible = 3  # never in a top-3 here: always rejected

    def propose(seq, cap):
        drafts, context = [], tuple(seq.output_token_ids)
        for _ in range(min(cap, 2)):
            choices = list(table.get(context, {})) + [impossible]
            drafts.append(rng.choice(choices))
            context += (drafts[-1],)
        return drafts

    monkeypatch.setattr(spec.speculator, "propose", propose)
    assert impossible not in {t for nexts in table.values() for t in nexts}
    # four tokens, so the step after the first may draft two (one of the model's own always follows)
    outs = spec.generate([prompt] * n, SamplingParams(max_tokens=4, temperature=1.0, top_k=k, ignore_eos=True),
                         use_tqdm=False)
    counts = {cell: 0 for cell in expected}
    for out in outs:
        counts[tuple(out.token_ids[:3])] += 1  # a continuation outside the table is a KeyError: a bug
    stats = spec.stats()
    accepted, drafted = stats.spec_num_accepted_tokens, stats.spec_num_draft_tokens
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    assert stats.spec_accepted_per_pos[1] > 0  # whole runs of two drafts were accepted too
    # cells expected fewer than 5 times are pooled, as the chi-square approximation asks
    cells = sorted(expected, key=expected.get)
    bins, pooled = [], [0.0, 0]
    for cell in cells:
        if expected[cell] * n < 5:
            pooled = [pooled[0] + expected[cell] * n, pooled[1] + counts[cell]]
        else:
            bins.append((expected[cell] * n, counts[cell]))
    if pooled[0]:
        bins.append(tuple(pooled))
    statistic = sum((seen - want) ** 2 / want for want, seen in bins)
    dof = len(bins) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(statistic / 2, dtype=torch.float64)).item()
    print(f"chi-square {statistic:.1f}, {dof} degrees of freedom, p = {p_value:.3f}")
    assert dof >= 10 and p_value > 1e-3, (statistic, dof, p_value)
    assert_engine_idle(spec)


def test_adaptive_draft_lengths_keep_the_output_and_back_off_where_rows_are_dear(engine, repeat, prompts, monkeypatch):
    """`draft_length: adaptive` with step costs given (the measurements switched off, so the
    choice does not depend on this machine's timing): where every row costs 20 ms (more than a
    plain step's seconds per token at any batch size) nothing drafts and every decoding request-step is counted as held back; where 64 rows
    cost a tenth more than one, the repetitive request drafts and its drafts are accepted. The
    tokens are those of speculation off either way."""
    batch, params = [repeat] + prompts[:3], greedy(24, ignore_eos=True)
    off = engine.generate(batch, params, use_tqdm=False)
    for costs, drafts in (({1: 0.010, 2: 0.030, 9: 0.170}, False), ({1: 0.010, 64: 0.011}, True)):
        spec = LLMEngine(dtype="float32", speculative_config=SPEC.replace("fixed", "adaptive"), **GPU_SHARE)
        lengths = spec.speculator.lengths
        monkeypatch.setattr(lengths, "observe_step", lambda tokens, seconds: None)
        for tokens, seconds in costs.items():
            lengths.cost.observe(tokens, seconds)
        on = spec.generate(batch, params, use_tqdm=False)
        assert [r.token_ids for r in on] == [r.token_ids for r in off]
        stats = spec.stats()
        if drafts:
            assert stats.spec_num_accepted_tokens >= 10
        else:
            assert stats.spec_num_draft_tokens == 0 and stats.spec_num_backed_off >= 4 * 23
        assert_engine_idle(spec)


def test_lora_requests_verify_their_drafts_through_their_adapters(small_llama, tmp_path, monkeypatch):
    """Requests of two adapters and of the base model in one batch, drafting (a proposer that drafts
    each request's own continuation without speculation, its last draft made wrong every third
    step, so runs are accepted whole, in part and not at all): the tokens equal speculation off."""
    from .lora_checks import mixed_adapter_batch

    settings, prompts, params = mixed_adapter_batch(small_llama, tmp_path / "adapters")
    settings.update(GPU_SHARE)
    off = LLMEngine(**settings).generate(prompts, params, use_tqdm=False)
    assert off[0].token_ids != off[2].token_ids  # the adapter changes the answer
    spec = LLMEngine(**settings, speculative_config="num_speculative_tokens=3,draft_length=fixed")
    reference = {(tuple(p), q.lora_name): r.token_ids for p, q, r in zip(prompts, params, off)}

    def propose(seq, cap):
        done = seq.num_output_tokens
        drafts = list(reference[(tuple(seq.prompt_token_ids), seq.params.lora_name)][done : done + min(cap, 3)])
        if drafts and done % 3 == 0:
            drafts[-1] = drafts[-1] + 1  # wrong: rejected there
        return drafts

    monkeypatch.setattr(spec.speculator, "propose", propose)
    on = spec.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = spec.stats()
    assert stats.spec_num_accepted_tokens >= 20 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_engine_idle(spec)


def test_structured_outputs_draft_and_equal_speculation_off(engine, spec_engine):
    """Constrained requests draft too: each verify row masked by the grammar after the drafts
    before it, n-gram drafts cut where the grammar refuses one. Greedy and seeded sampled JSON
    schemas, a regex, and a choice whose grammar ends inside an accepted run (ignore_eos: it ends
    where it is complete) give speculation off's tokens, and drafts are accepted."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 6}},
              "required": ["name", "items"], "additionalProperties": False}
    prompt = engine.encode('Copy this JSON exactly: {"name": "shopping list", "items": ["apples", "pears", '
                           '"plums", "apples", "pears", "plums"]}\nJSON:')
    params = [SamplingParams.from_dict(p) for p in (
        {"max_tokens": 80, "temperature": 0, "structured_outputs": {"json": schema}},
        {"max_tokens": 80, "temperature": 0.8, "seed": 3, "structured_outputs": {"json": schema}},
        {"max_tokens": 80, "temperature": 1.0, "top_p": 0.9, "seed": 4, "logprobs": 1, "structured_outputs": {"json": schema}},
        {"max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": "(apples, pears, plums, ){2,4}done"}},
        {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "guided_choice": ["apples, pears, plums"]},
    )]
    before = spec_engine.stats().spec_num_accepted_tokens
    off = engine.generate([prompt] * len(params), params, use_tqdm=False)
    on = spec_engine.generate([prompt] * len(params), params, use_tqdm=False)
    for a, b in zip(off, on):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert [x.logprob for x in on[2].logprobs] == pytest.approx([x.logprob for x in off[2].logprobs], abs=1e-4)
    assert json.loads(on[0].text)["items"] and on[4].text == "apples, pears, plums"
    assert spec_engine.stats().spec_num_accepted_tokens - before >= 10
    assert_engine_idle(spec_engine)


def test_penalties_bad_words_and_min_tokens_draft_and_equal_speculation_off(engine, spec_engine, repeat, prompts):
    """Each verify row's processors read the request's tokens with the drafts before the row, so
    repetition / presence / frequency penalties, bad words and a pending min_tokens give
    speculation off's tokens, greedy and seeded sampled, and their drafts are accepted."""
    params = [greedy(40, repetition_penalty=1.05, ignore_eos=True),
              greedy(40, presence_penalty=0.4, frequency_penalty=0.2, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=9, frequency_penalty=0.5, ignore_eos=True, logprobs=1),
              greedy(40, bad_words=["cherry", "fig"], ignore_eos=True),
              greedy(30, min_tokens=30),
              SamplingParams(max_tokens=24, temperature=0.9, seed=2, presence_penalty=0.3, min_tokens=10)]
    batch = [repeat] * 5 + [prompts[1]]
    before = spec_engine.stats().spec_num_accepted_tokens
    off = engine.generate(batch, params, use_tqdm=False)
    on = spec_engine.generate(batch, params, use_tqdm=False)
    for a, b in zip(off, on):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert [x.logprob for x in on[2].logprobs] == pytest.approx([x.logprob for x in off[2].logprobs], abs=1e-4)
    assert "cherry" not in on[3].text and len(on[4].token_ids) == 30
    assert spec_engine.stats().spec_num_accepted_tokens - before >= 20
    assert_engine_idle(spec_engine)
