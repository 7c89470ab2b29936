"""LoRA adapters served per request (backend/lora/): PEFT adapters made on a small random Llama give
transformers + peft's greedy tokens, token for token, each request its own adapter's in one batch
that mixes the base model and three adapters (chunked prefill, prefix hits, fewer device slots than
adapters); the prefix cache never hands one adapter's keys to another; bad adapters fail the load
naming them, unknown ones fail the request naming `lora_name`."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.config import EngineConfig
from pagedserve.backend.errors import ConfigError, InvalidRequestError
from pagedserve.backend.lora.adapter import read_lora_modules

from .conftest import GPU_SHARE, assert_engine_idle
from .lora_checks import ADAPTERS, greedy, write_adapters

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(small_llama, tmp_path_factory):
    """(multi_lora.json path, name -> transformers + peft model) for ADAPTERS on `small_llama`."""
    return write_adapters(small_llama, tmp_path_factory.mktemp("adapters"))


def engine_for(small_llama: str, modules: str, **settings) -> LLMEngine:
    return LLMEngine(model=small_llama, dtype="float32", enable_lora=True, lora_modules=modules,
                     max_num_batched_tokens=32, **{**GPU_SHARE, **settings})


@pytest.mark.parametrize("max_loras,async_scheduling", [(4, "off"), (1, "on")], ids=["slots-for-all", "one-slot-async"])
def test_a_batch_mixing_adapters_gives_each_request_its_own_adapters_tokens(small_llama, small_prompts, adapters,
                                                                            max_loras, async_scheduling):
    """Base and three adapters in one continuous batch (32-token steps chunk the long prompts),
    twice (the second time from the prefix cache): every request gets transformers + peft's greedy
    tokens for its adapter. With one slot the adapters take turns in it (and each step is planned
    while the one before runs: async scheduling)."""
    from transformers import AutoModelForCausalLM

    modules, references = adapters
    base = AutoModelForCausalLM.from_pretrained(small_llama, dtype=torch.float32).eval()
    engine = engine_for(small_llama, modules, max_loras=max_loras, async_scheduling=async_scheduling)
    names = [None, *ADAPTERS]
    jobs = [(names[i % 4], prompt) for i, prompt in enumerate(small_prompts * 2)]
    expected = [greedy(references[name] if name else base, prompt, 8) for name, prompt in jobs]
    assert len({tuple(e) for e, (_, p) in zip(expected, jobs) if p == jobs[0][1]}) > 1  # the adapters change answers
    for _ in range(2):
        params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, lora_name=name) for name, _ in jobs]
        results = engine.generate([prompt for _, prompt in jobs], params, use_tqdm=False)
        assert [r.token_ids for r in results] == expected
    assert_engine_idle(engine)


def test_the_prefix_cache_is_keyed_by_adapter(small_llama, small_prompts, adapters):
    """A prompt the base model has cached is computed afresh for an adapter, and the adapter's
    own second run hits its own cache."""
    modules, references = adapters
    engine = engine_for(small_llama, modules)
    prompt = small_prompts[2]
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, lora_name="q-and-v")
    first, again = (engine.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert first.token_ids == again.token_ids == greedy(references["q-and-v"], prompt, 4)


def test_an_unknown_adapter_is_refused_naming_lora_name(small_llama, adapters):
    engine = engine_for(small_llama, adapters[0])
    with pytest.raises(InvalidRequestError, match="unknown adapter 'nope'.*every-projection") as error:
        engine.add_request([1, 2, 3], SamplingParams(lora_name="nope"))
    assert error.value.field == "lora_name"
    plain = LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE)
    with pytest.raises(InvalidRequestError, match="serves no adapters.*enable_lora"):
        plain.add_request([1, 2, 3], SamplingParams(lora_name="q-and-v"))
    assert_engine_idle(engine)


def test_an_adapter_pagedserve_cannot_serve_fails_the_load_naming_it(small_llama, adapters, tmp_path):
    modules, _ = adapters
    folder = json.loads(open(modules).read())["mlp-rslora"]
    with pytest.raises(ConfigError, match="'mlp-rslora'.*rank 16 is above max_lora_rank 8"):
        engine_for(small_llama, modules, max_lora_rank=8)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads(open(f"{modules.rsplit('/', 1)[0]}/{folder}/adapter_config.json").read())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match="'d'.*use_dora=True is not supported"):
        engine_for(small_llama, f"d={dora}")


def test_lora_settings_are_checked_once():
    assert read_lora_modules("a=/x, b=/y") == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="enable_lora is false"):
        EngineConfig(lora_modules="a=/x")
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig(enable_lora=True, max_lora_rank=12)
    with pytest.raises(ConfigError, match="enable_lora.*tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="enable_lora.*compile"):
        EngineConfig(enable_lora=True, compile="on")
    with pytest.raises(ConfigError, match="enable_lora.*deterministic"):
        EngineConfig(enable_lora=True, deterministic=True)
