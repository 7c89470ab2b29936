"""Speculative decoding set in a model repository (`speculative_config` in llm/config.pbtxt), n-gram,
a draft model and an EAGLE-3 head, through a real tritonserver: the vLLM backend's `llm` (gRPC
streamed, HTTP generate), the TensorRT-LLM ensemble and the OpenAI gateway (the openai SDK, streamed
and not) each give the offline engine's text without speculation, greedy and seeded sampled; the
spec_decode counters show drafts were verified (and accepted, but for the random head's), and the
server ends idle (no KV block held after a cancelled speculative stream)."""

from __future__ import annotations

import json
import sys
import urllib.request

import openai
import pytest

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from ..eagle3_checks import write_eagle3_head
from .conftest import gateway_process, llm_inputs, metric, stream_request, tensor, texts, wait_idle

SPEC = "method=ngram,num_speculative_tokens=4,prompt_lookup_min=1,prompt_lookup_max=3,draft_length=fixed"
# prompts on which this random model's greedy tokens accept some of prompt lookup's drafts
PROMPTS = ["a a a a a a a a a a a a", "in in in in in in in"]


def streamed_text(engine: LLMEngine, prompt: str, params: SamplingParams) -> str:
    request_id, outputs = engine.add_request(prompt, params), []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return "".join(o.text for o in outputs)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_every_entry_point_gives_the_text_of_speculation_off(tmp_path, small_llama, method):
    offline = LLMEngine(model=small_llama, dtype="float32")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    # a random model's stray byte pieces render differently token by token than decoded whole; the server
    # renders token by token on every entry point, so the offline engine's stream is the reference
    streamed = {prompt: streamed_text(offline, prompt, greedy) for prompt in PROMPTS}
    expected_seeded = streamed_text(offline, PROMPTS[0], seeded)
    expected_ensemble = streamed_text(offline, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0))

    # the draft model: the target itself (every draft accepted), its own cache beside the target's; a random EAGLE-3 head
    spec = {"ngram": SPEC, "draft_model": f"model={small_llama},num_speculative_tokens=3,draft_length=fixed",
            "eagle3": f"method=eagle3,model={write_eagle3_head(str(tmp_path / 'head'), small_llama)},"
                      "num_speculative_tokens=3,draft_length=fixed"}[method]
    engine = {"dtype": "float32", "speculative_config": spec, "REPORT_CUSTOM_METRICS": "true"}
    repository = write_repository(tmp_path / "repo", model=small_llama, engine=engine)
    models = ["llm", "preprocessing", "tensorrt_llm", "postprocessing", "ensemble"]
    with TritonServer(repository, log_file=tmp_path / "server.log", models=models).start(timeout=300) as server:
        for prompt in PROMPTS:  # gRPC, streamed: the vLLM backend's contract
            results, error = stream_request(server, llm_inputs(prompt, max_tokens=24, temperature=0, ignore_eos=True))
            assert error is None and "".join(texts(results)) == streamed[prompt]
        results, error = stream_request(server, llm_inputs(PROMPTS[0], max_tokens=24, temperature=0.8, top_p=0.95,
                                                           seed=7, ignore_eos=True))
        assert error is None and "".join(texts(results)) == expected_seeded
        sampling = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        body = {"text_input": PROMPTS[1], "exclude_input_in_output": True, "sampling_parameters": json.dumps(sampling)}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(request, timeout=120))["text_output"] == streamed[PROMPTS[1]]
        results, error = stream_request(server, [tensor("text_input", PROMPTS[0], shape=[1, 1]),
                                                 tensor("max_tokens", 24, shape=[1, 1]), tensor("stream", True, shape=[1, 1])],
                                        model="ensemble")
        assert error is None and "".join(texts(results)) == expected_ensemble

        command = [sys.executable, "-m", "pagedserve.client.cli", "openai", "--triton-url", server.grpc_url]
        with gateway_process(command, tmp_path / "gateway.log") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            done = client.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert done.choices[0].text == streamed[PROMPTS[0]]
            chunks = client.completions.create(model="llm", prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in chunks if c.choices) == streamed[PROMPTS[1]]

        _, error = stream_request(server, llm_inputs(PROMPTS[0], max_tokens=200, temperature=0, ignore_eos=True),
                                  cancel_after=3)  # cancelled mid-stream, drafting
        wait_idle(server)
        assert metric(server, "vllm:spec_decode_num_draft_tokens_total") > 0
        if method != "eagle3":  # a random head's drafts are rarely the target's tokens
            assert metric(server, "vllm:spec_decode_num_accepted_tokens_total") > 0
        assert metric(server, "vllm:spec_decode_num_draft_tokens_total") >= metric(
            server, "vllm:spec_decode_num_accepted_tokens_total")
