"""n parallel samples and the vLLM-named metrics, on a real server: n = 3 gives three
samples in sample order that share the prompt's KV blocks, and a known batch of
requests moves every counter and histogram by exactly what vLLM's backend would."""

from __future__ import annotations

import json

from pagedserve.backend import SamplingParams

from .conftest import metric, tensor, wait_idle
from .test_contract_outputs import grpc_llm

PROMPT = "Tell me about the history of the city of Paris, its rivers and bridges, in detail:"


def test_n_3_returns_three_samples_that_share_the_prompt_blocks(server, engine):
    wait_idle(server)
    hits_before = metric(server, "pagedserve:prefix_cache_hits_total")
    sampling = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}
    inputs = [tensor("text_input", PROMPT), tensor("stream", True), tensor("sampling_parameters", json.dumps(sampling)),
              tensor("return_finish_reason", True), tensor("return_num_output_tokens", True)]
    responses = grpc_llm(server, inputs)
    deltas = [[t.decode() for t in r.as_numpy("text_output")] for r in responses]
    assert {len(d) for d in deltas} == {3}
    samples = ["".join(d[i] for d in deltas) for i in range(3)]
    assert [r.as_numpy("finish_reason").tolist() for r in responses][-1] == [b"length"] * 3
    assert [sum(r.as_numpy("num_output_tokens")[i] for r in responses) for i in range(3)] == [12] * 3
    assert len(set(samples)) == 3  # seeded samples differ from one another ...
    offline = engine.generate([PROMPT], [SamplingParams(**sampling)], use_tqdm=False)[0]
    assert samples == [s.text for s in offline.samples]  # ... and repeat the engine's own
    wait_idle(server)
    prompt_tokens = len(engine.encode(PROMPT))
    full_blocks = (prompt_tokens - 1) // 16
    assert metric(server, "pagedserve:prefix_cache_hits_total") - hits_before >= 2 * full_blocks * 16 > 0


VLLM_FAMILIES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum", "vllm:request_params_n_sum",
                 "vllm:request_params_n_count")


def test_metrics_of_a_known_batch_are_exact(server, engine):
    wait_idle(server)
    before = {name: metric(server, name) for name in VLLM_FAMILIES}
    prompts = ["The capital of France is", "Three colours of the rainbow are", "Hello"]
    lengths = [4, 7, 1]
    for prompt, max_tokens in zip(prompts, lengths):
        sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        grpc_llm(server, [tensor("text_input", prompt), tensor("stream", True),
                          tensor("sampling_parameters", json.dumps(sampling))])
    wait_idle(server)
    delta = {name: metric(server, name) - before[name] for name in VLLM_FAMILIES}
    prompt_tokens = sum(len(engine.encode(p)) for p in prompts)
    assert delta == {
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": 12,
        "vllm:time_to_first_token_seconds_count": 3,
        "vllm:time_per_output_token_seconds_count": 3 + 6 + 0,  # one per token after the first
        "vllm:e2e_request_latency_seconds_count": 3,
        "vllm:request_prompt_tokens_sum": prompt_tokens,
        "vllm:request_generation_tokens_sum": 12,
        "vllm:request_params_n_sum": 3,
        "vllm:request_params_n_count": 3,
    }
