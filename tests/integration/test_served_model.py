"""A non-default model named once (`model` of llm, the engine's model): every model that tokenizes
uses its tokenizer, so served text equals the engine's offline generation."""

from __future__ import annotations

import pytest
import torch
import tritonclient.grpc as grpcclient

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.client.client import LLMClient
from pagedserve.client.repository import set_parameters, write_repository
from pagedserve.client.triton_server import TritonServer

from .test_trtllm_contract import trt_text
from .conftest import failed_load_log, tensor

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was"]


@pytest.fixture(scope="module")
def own_model(tmp_path_factory, sentencepiece_tokenizer):
    """A small random Llama with a tokenizer unlike SmolLM2's, built in-process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("own-model")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(sentencepiece_tokenizer), max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    sentencepiece_tokenizer.save_pretrained(directory)
    return str(directory)


def test_served_text_uses_the_served_models_tokenizer(tmp_path, own_model, sentencepiece_tokenizer):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    offline = LLMEngine(model=own_model, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    repository = write_repository(tmp_path / "repo", model=own_model, engine={"dtype": "float32"})
    for name in ("llm_engine", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):  # one place names the model
        assert 'key: "model"' not in (repository / name / "config.pbtxt").read_text()
    with TritonServer(repository, log_file=tmp_path / "server.log").start(timeout=300) as server:
        client = LLMClient(server.grpc_url)
        served = [client.generate(p, max_tokens=12, temperature=0, ignore_eos=True) for p in PROMPTS]
        assert served == [c.text for c in offline]
        with grpcclient.InferenceServerClient(server.grpc_url) as triton:
            result = triton.infer("preprocessing", [tensor("QUERY", PROMPTS[0], shape=[1, 1])])
        assert result.as_numpy("INPUT_ID").tolist() == [sentencepiece_tokenizer.encode(PROMPTS[0])]
        ensemble = "".join(trt_text(server, "ensemble", PROMPTS[0], 12, exclude_input_in_output=True))  # the ensemble's steps use its tokenizer too
        assert ensemble == offline[0].text or offline[0].text.startswith(ensemble)


def test_a_tokenizer_model_naming_another_model_fails_its_load(tmp_path, own_model):
    repository = write_repository(tmp_path / "repo", model=own_model)
    set_parameters(repository / "postprocessing" / "config.pbtxt", {"model": "/some/other/model"})
    assert "set `model` only in llm/config.pbtxt" in failed_load_log(repository, tmp_path / "server.log", timeout=300,
                                                                      models=["postprocessing"])
