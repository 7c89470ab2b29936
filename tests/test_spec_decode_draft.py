"""Speculative decoding with a draft model (spec_decode/draft_model.py): the bundled model in float32
drafted by its own Q4 GGUF in bfloat16 (drafts mostly accepted), and a random Llama drafted by its
first layer alone (drafts partly accepted): greedy tokens, text, stops and logprobs equal to
speculation off, beside prompt chunks, under preemption, with n = 2 and seeded sampling; the
draft's cache paid from the KV budget; no block held after a cancelled request; and a draft of
another tokenizer refused at load."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.device import kv_block_bytes
from pagedserve.backend.errors import ConfigError
from pagedserve.backend.model_files import default_model_path

from .conftest import GPU_SHARE, MAX_TOKENS, assert_engine_idle

pytestmark = pytest.mark.slow

REPEAT = ("apple banana cherry date elderberry fig grape\n" * 3) + "apple banana"


def spec(model: str, k: int = 4, **keys) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "draft_length": "fixed", **keys}


@pytest.fixture(scope="module")
def draft_engine() -> LLMEngine:
    """The bundled model in float32, drafted by its GGUF in bfloat16; a small token budget, so
    prompts are chunked beside the verifies."""
    return LLMEngine(dtype="float32", speculative_config=spec(default_model_path(), dtype="bfloat16"),
                     max_num_batched_tokens=32, **GPU_SHARE)


def greedy(n, **params):
    return SamplingParams(max_tokens=n, temperature=0.0, **params)


def accepted(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.spec_num_accepted_tokens, stats.spec_num_draft_tokens


def test_greedy_batch_with_chunks_logprobs_and_stops_equals_speculation_off(engine, draft_engine, prompts):
    repeat = engine.encode(REPEAT)
    batch = [repeat] + prompts
    params = [greedy(40, ignore_eos=True, logprobs=2)] + [greedy(n) for n in MAX_TOKENS]
    before = accepted(draft_engine)
    off = engine.generate(batch, params, use_tqdm=False)
    on = draft_engine.generate(batch, params, use_tqdm=False)
    for a, b in zip(off, on):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert [x.logprob for x in on[0].logprobs] == pytest.approx([x.logprob for x in off[0].logprobs], abs=1e-4)
    after = accepted(draft_engine)
    gained, drafted = after[0] - before[0], after[1] - before[1]
    assert gained > 0.7 * drafted > 0, (gained, drafted)  # the Q4 draft of the same weights mostly agrees
    # a stop string inside an accepted run: the text ends where it does without speculation
    text = off[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    cut = [engine.generate([repeat], greedy(40, stop=[stop]), use_tqdm=False)[0],
           draft_engine.generate([repeat], greedy(40, stop=[stop]), use_tqdm=False)[0]]
    assert cut[1].text == cut[0].text and cut[1].token_ids == cut[0].token_ids and cut[1].finish_reason == "stop"
    assert_engine_idle(draft_engine)


def test_n_samples_and_seeded_sampling_equal_speculation_off(engine, draft_engine, prompts):
    repeat = engine.encode(REPEAT)
    two = SamplingParams(max_tokens=24, temperature=0.0, n=2, ignore_eos=True)
    assert ([s.token_ids for s in draft_engine.generate([repeat], two, use_tqdm=False)[0].samples]
            == [s.token_ids for s in engine.generate([repeat], two, use_tqdm=False)[0].samples])
    batch = [repeat, prompts[1]]
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=8)]
    off = engine.generate(batch, params, use_tqdm=False)
    on = draft_engine.generate(batch, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert_engine_idle(draft_engine)


def test_a_cancelled_request_holds_no_block_in_either_cache(engine, draft_engine):
    repeat = engine.encode(REPEAT)
    request_id = draft_engine.add_request(repeat, greedy(200, ignore_eos=True))
    before = accepted(draft_engine)[1]
    while accepted(draft_engine)[1] == before:
        draft_engine.step()
    draft_engine.abort(request_id)
    assert_engine_idle(draft_engine)
    assert not draft_engine.has_unfinished_requests()


def test_the_drafts_cache_is_paid_from_the_kv_budget(engine):
    budget = 64 * 2**20
    path = default_model_path()
    with_draft = LLMEngine(dtype="float32", kv_cache_bytes=budget, speculative_config=spec(path, dtype="bfloat16"))
    config = engine.model_config
    size = with_draft.config.block_size
    target = kv_block_bytes(config, size, engine.kv_dtype)
    draft = kv_block_bytes(config, size, with_draft.speculator.draft.dtype)
    assert with_draft.block_manager.num_blocks == budget // (target + draft)
    assert with_draft.speculator.draft.runner.kv_caches[0].key.shape[0] == with_draft.block_manager.num_blocks


@pytest.fixture(scope="module")
def first_layer_draft(small_llama, tmp_path_factory) -> str:
    """small_llama's first layer alone, with its embeddings, norm and head: a draft that agrees
    with its target on some tokens."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(small_llama)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    directory = tmp_path_factory.mktemp("first-layer-draft")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(small_llama).save_pretrained(directory)
    return str(directory)


def test_a_partly_agreeing_draft_under_preemption_equals_speculation_off(small_llama, small_prompts, first_layer_draft):
    params = [greedy(n, ignore_eos=True) for n in (30, 12, 40, 25, 18)]
    plain = LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE)
    off = plain.generate(small_prompts, params, use_tqdm=False)
    tight = LLMEngine(model=small_llama, dtype="float32", num_kv_blocks=14, max_num_batched_tokens=48,
                      speculative_config=spec(first_layer_draft, k=3))
    on = tight.generate(small_prompts, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, accepted(tight)
    assert_engine_idle(tight)


def test_the_drafts_one_token_forwards_over_decode_graph_buffers_draft_as_eager(small_llama, small_prompts,
                                                                                 first_layer_draft):
    """On a GPU the draft's forwards of one token a request replay decode graphs of the draft's own
    (its first pass over a request's new tokens runs eager). Here over those graphs' static buffers,
    run eagerly: every draft equal to the eager draft's, the tokens equal to speculation off, the
    buffers taking steps of several requests."""
    from .test_cuda_graphs import _with_static_decode, drafts_eager_and_over_static_buffers

    params = [greedy(n, ignore_eos=True) for n in (30, 12, 40, 25, 18)]
    off = LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE).generate(small_prompts, params, use_tqdm=False)
    used: list[list[int]] = []
    eager, static = drafts_eager_and_over_static_buffers(
        lambda: LLMEngine(model=small_llama, dtype="float32", max_num_batched_tokens=48,
                          speculative_config=spec(first_layer_draft, k=3), **GPU_SHARE),
        lambda engine: used.append(_with_static_decode(engine, 4, engine.speculator.draft.runner)),
        small_prompts, params, [r.token_ids for r in off])
    assert static == eager and any(eager)
    assert max(used[0]) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_draft_and_the_verify_replay_captured_graphs(small_llama, small_prompts, first_layer_draft):
    params = [greedy(n, ignore_eos=True) for n in (30, 12, 40, 25, 18)]
    off = LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE).generate(small_prompts, params, use_tqdm=False)
    engine = LLMEngine(model=small_llama, dtype="float32", speculative_config=spec(first_layer_draft, k=3), **GPU_SHARE)
    for graphs in (engine.speculator.draft.runner.graphs, engine.runner.verify_graphs):
        assert graphs is not None and all(g is not None for g in graphs.graphs.values())
    on = engine.generate(small_prompts, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert_engine_idle(engine)


def test_a_draft_of_another_tokenizer_is_refused_naming_both(small_llama):
    with pytest.raises(ConfigError, match="another tokenizer") as error:
        LLMEngine(dtype="float32", speculative_config=spec(small_llama), **GPU_SHARE)
    assert error.value.field == "speculative_config"
    assert small_llama in str(error.value) and default_model_path() in str(error.value)
    with pytest.raises(ConfigError, match="no such file") as error:
        LLMEngine(dtype="float32", speculative_config=spec("/nonexistent/draft"), **GPU_SHARE)


def test_structured_outputs_draft_and_equal_speculation_off(engine, draft_engine):
    """The draft model drafts without the grammar; each verify row is masked by the grammar after
    the drafts before it, so drafts it refuses are rejected there, and a choice that ends inside
    an accepted run (ignore_eos) stops where it is complete."""
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["colour", "ok"], "additionalProperties": False}
    prompt = engine.encode("Answer in JSON. Describe something you like:")
    params = [SamplingParams.from_dict(p) for p in (
        {"max_tokens": 60, "temperature": 0, "structured_outputs": {"json": schema}},
        {"max_tokens": 60, "temperature": 0.9, "seed": 5, "structured_outputs": {"json": schema}},
        {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "guided_choice": ["a cat", "a dog sleeping"]},
    )]
    before = accepted(draft_engine)[0]
    off = engine.generate([prompt] * len(params), params, use_tqdm=False)
    on = draft_engine.generate([prompt] * len(params), params, use_tqdm=False)
    for a, b in zip(off, on):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert on[2].text in ("a cat", "a dog sleeping")
    assert accepted(draft_engine)[0] > before
    assert_engine_idle(draft_engine)


def test_lora_requests_draft_from_the_base_draft_and_equal_speculation_off(small_llama, tmp_path):
    """The draft has no adapters (it drafts the base model's continuation); each adapter's request
    verifies through its adapter and gets speculation off's tokens, beside a base request."""
    from .lora_checks import mixed_adapter_batch

    settings, prompts, params = mixed_adapter_batch(small_llama, tmp_path / "adapters")
    settings.update(GPU_SHARE)
    off = LLMEngine(**settings).generate(prompts, params, use_tqdm=False)
    drafted = LLMEngine(**settings, speculative_config=spec(small_llama, k=3))
    assert [r.token_ids for r in drafted.generate(prompts, params, use_tqdm=False)] == [r.token_ids for r in off]
    stats = drafted.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # the base draft is right for the base request
    assert_engine_idle(drafted)
