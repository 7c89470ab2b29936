"""Decode steps over static buffers (backend/cuda_graphs.py): the same greedy tokens as the
piecewise step, whatever the batch size (padded to a bucket), with preemption and with
more sequences than the largest bucket. On CPU the buffers' layout and padding are checked
by running each bucket eagerly over them; on a GPU the captured graphs replay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.cuda_graphs import SHORT_CONTEXT, DecodeGraphs, graph_sizes

from .conftest import GPU_SHARE, assert_engine_idle

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_graph_sizes_cover_every_batch_up_to_the_largest():
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35


def test_short_contexts_replay_the_graph_captured_without_the_key_split():
    runner = SimpleNamespace(device=torch.device("cpu"), block_size=16)
    graphs = DecodeGraphs(runner, 128, 4096)
    graphs.graphs = dict.fromkeys(graphs.keys())
    assert graphs.key(3, 200) == (4, SHORT_CONTEXT) and graphs.key(3, SHORT_CONTEXT + 1) == (4, 4096)
    assert graphs.key(100, 100) == (104, 4096)  # past SHORT_BATCH: one graph per size
    assert {context for _, context in DecodeGraphs(runner, 8, 256).keys()} == {256}


def _engine(small_llama: str, **settings) -> LLMEngine:
    return LLMEngine(model=small_llama, dtype="float32", compile="off", **{"attention_backend": "torch", **GPU_SHARE, **settings})


def _with_static_decode(engine: LLMEngine, max_seqs: int, runner=None) -> list[int]:
    """Give the engine's runner (or `runner`, a draft's) decode steps over static buffers; returns
    a list that records each such step's batch size."""
    runner = runner or engine.runner
    runner.graphs = DecodeGraphs(runner, max_seqs, engine.max_model_len)
    runner.graphs.capture()
    used: list[int] = []
    run = runner.graphs.run

    def recording(batch):
        used.append(len(batch.seqs))
        return run(batch)

    runner.graphs.run = recording
    return used


@pytest.mark.parametrize("num_kv_blocks,async_scheduling", [(1024, "off"), (14, "off"), (1024, "on"), (14, "on")])
def test_static_decode_steps_give_the_piecewise_tokens(small_llama, small_prompts, num_kv_blocks, async_scheduling):
    """Five prompts (7-164 tokens), outputs of 5-40 tokens: the batch shrinks through
    every bucket, each sequence keeping its row while the others leave; with 14 KV blocks
    requests are preempted and recomputed (their block tables rebuilt); with async
    scheduling the inputs come from the step before's tokens on the device."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test below replays the captured graphs")
    settings = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=6, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in [40, 5, 23, 12, 31]]
    plain = _engine(small_llama, **settings)
    expected = [r.token_ids for r in plain.generate(small_prompts, params, use_tqdm=False)]
    static = _engine(small_llama, async_scheduling=async_scheduling, **settings)
    used = _with_static_decode(static, max_seqs=4)
    results = static.generate(small_prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == expected
    assert {1, 2, 3} <= set(used), f"decode batches seen: {sorted(set(used))}"
    assert_engine_idle(static)
    if num_kv_blocks == 14:
        assert static.stats().num_preemptions > 0


SPEC = "method=ngram,num_speculative_tokens=3,prompt_lookup_min=1,prompt_lookup_max=2,draft_length=fixed"


def oracle_drafts(engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Drafts from the tokens speculation off gave (a random model repeats nothing for n-gram to
    find): after g tokens, g % 4 of them (0 to 3), the last one wrong every fifth time, so verifies
    accept, reject and mix draft counts."""
    by_prompt = {tuple(p): e for p, e in zip(prompts, expected)}
    speculator = engine.speculator

    def propose(seq, cap):
        made = seq.num_output_tokens
        drafts = list(by_prompt[tuple(seq.token_ids[: seq.num_prompt_tokens])][made : made + min(cap, made % 4)])
        if drafts and made % 5 == 0:
            drafts[-1] = (drafts[-1] + 1) % 100
        return drafts

    speculator.propose = propose


def drafts_eager_and_over_static_buffers(make_engine, install, prompts: list, params: list,
                                         expected: list[list[int]]) -> tuple[list, list]:
    """The proposals of an engine as `make_engine` builds it and of one `install` gave static
    buffers (run eagerly off CUDA), each generating `prompts` with the tokens `expected`."""
    proposed = []
    for static in (False, True):
        engine = make_engine()
        if static:
            install(engine)
        draft = engine.speculator.draft
        propose, drafts = draft.propose, []
        draft.propose = lambda batch, counts: drafts.append(propose(batch, counts)) or drafts[-1]
        assert [r.token_ids for r in engine.generate(prompts, params, use_tqdm=False)] == expected
        assert_engine_idle(engine)
        proposed.append(drafts)
    return proposed[0], proposed[1]


def _with_static_verify(engine: LLMEngine, max_seqs: int) -> list[tuple[int, int]]:
    """Give the engine's runner decode and verify steps over static buffers; returns a list that
    records each verify step's (batch size, draft tokens)."""
    runner = engine.runner
    _with_static_decode(engine, max_seqs)
    runner.verify_graphs = DecodeGraphs(runner, max_seqs, engine.max_model_len, query_len=4)
    runner.verify_graphs.capture()
    used: list[tuple[int, int]] = []
    run = runner.verify_graphs.run

    def recording(batch):
        used.append((len(batch.seqs), sum(map(len, batch.drafts))))
        return run(batch)

    runner.verify_graphs.run = recording
    return used


@pytest.mark.parametrize("sampled,attention", [(False, "torch"), (True, "torch"), (False, "triton")],
                         ids=["greedy", "seeded-sampled", "greedy-triton-attention"])
def test_verify_steps_over_static_buffers_give_the_tokens_of_speculation_off(small_llama, small_prompts, sampled, attention):
    """Speculation with 3 drafts a step (oracle drafts, accepted and rejected): verify steps of 1 to
    4 sequences with any mix of draft counts (a sequence with fewer fills its 4 rows with padding)
    over the verify graphs' buffers give the tokens of speculation off, greedy and seeded sampled; a
    batch of 6 is past the largest bucket and verifies eagerly. The Triton attention (through its
    interpreter here) reads the padded layout as the GPU will."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test below replays the captured graphs")
    settings = dict(max_num_seqs=6, max_num_batched_tokens=64)
    prompts = small_prompts + [small_prompts[0] * 6]
    make = (lambda n, i: SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True)) if sampled else \
        (lambda n, i: SamplingParams(max_tokens=n, **GREEDY))
    params = [make(n, i) for i, n in enumerate([40, 5, 23, 12, 31, 36])]
    expected = [r.token_ids for r in _engine(small_llama, **settings).generate(prompts, params, use_tqdm=False)]
    static = _engine(small_llama, speculative_config=SPEC, **settings, attention_backend=attention)
    used = _with_static_verify(static, max_seqs=4)
    oracle_drafts(static, prompts, expected)
    results = static.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == expected
    assert static.stats().spec_num_accepted_tokens > 0
    assert {1, 2} <= {size for size, _ in used}, used
    assert any(drafts < 3 * size for size, drafts in used)  # some sequence verified fewer than 3 drafts: padding rows
    assert_engine_idle(static)


def test_verify_graphs_that_fail_to_capture_leave_verify_steps_eager(small_llama, small_prompts, caplog):
    """The verify graphs are an optimisation: a capture that fails is logged and the eager verify
    serves (the decode graphs' own failure still stops the engine)."""
    engine = _engine(small_llama, speculative_config=SPEC, max_num_seqs=4)
    runner = engine.runner
    _with_static_decode(engine, max_seqs=4)
    broken = DecodeGraphs(runner, 4, engine.max_model_len, query_len=4)
    broken.capture = lambda: (_ for _ in ()).throw(RuntimeError("operation not permitted when stream is capturing"))
    runner.verify_graphs = broken
    with caplog.at_level("WARNING", logger="pagedserve"):
        runner.capture_graphs()
    assert runner.verify_graphs is None and "verify steps run eager" in caplog.text
    params = SamplingParams(max_tokens=12, **GREEDY)
    plain = _engine(small_llama, max_num_seqs=4).generate(small_prompts[:2], params, use_tqdm=False)
    assert [r.token_ids for r in engine.generate(small_prompts[:2], params, use_tqdm=False)] == [r.token_ids for r in plain]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_verify_graphs_give_the_tokens_of_speculation_off(small_llama, small_prompts):
    settings = dict(max_num_seqs=6, max_num_batched_tokens=64, dtype="float32")
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in [40, 5, 23, 12, 31]]
    expected = [r.token_ids for r in LLMEngine(model=small_llama, **{**GPU_SHARE, **settings}).generate(
        small_prompts, params, use_tqdm=False)]
    spec = LLMEngine(model=small_llama, speculative_config=SPEC, **{**GPU_SHARE, **settings})
    verify = spec.runner.verify_graphs
    assert verify is not None and all(g is not None for g in verify.graphs.values())
    replayed: list[int] = []
    run = verify.run
    verify.run = lambda batch: replayed.append(len(batch.seqs)) or run(batch)  # type: ignore[method-assign]
    results = spec.generate(small_prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == expected and replayed
    assert spec.stats().spec_num_accepted_tokens > 0
    assert_engine_idle(spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_captured_decode_graphs_give_the_eager_tokens(small_llama, small_prompts, quantization):
    settings = dict(max_num_seqs=6, max_num_batched_tokens=64, dtype="bfloat16", quantization=quantization)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in [40, 5, 23, 12, 31]]
    eager = LLMEngine(model=small_llama, compile="off", **{**GPU_SHARE, **settings})
    expected = [r.token_ids for r in eager.generate(small_prompts, params, use_tqdm=False)]
    del eager
    graphed = LLMEngine(model=small_llama, **{**GPU_SHARE, **settings})
    assert graphed.runner.graphs is not None and all(g is not None for g in graphed.runner.graphs.graphs.values())
    results = graphed.generate(small_prompts, params, use_tqdm=False)
    matching = sum(r.token_ids == e for r, e in zip(results, expected))
    # bf16: the compiled pieces fuse and round differently from eager; most sequences agree
    assert matching >= 3 if quantization == "none" else matching == len(expected)
    assert_engine_idle(graphed)
