"""Concurrent streams batch together; cancelled streams free their KV blocks at once."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from pagedserve.backend import SamplingParams
from pagedserve.client.client import LLMClient

from .conftest import llm_inputs, metric, stream_request, wait_idle


def test_sixteen_concurrent_streams_complete_correctly_and_batch_together(server, engine):
    wait_idle(server)
    prompts = [f"Write a sentence about the number {i}." for i in range(16)]
    lengths = [8 + 4 * i for i in range(16)]
    results: dict[int, str] = {}

    def client(i):
        chunks = LLMClient(server.grpc_url).stream(prompts[i], max_tokens=lengths[i], temperature=0, ignore_eos=True)
        results[i] = "".join(c.text for c in chunks)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    offline = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths], use_tqdm=False)
    assert [results[i] for i in range(16)] == [c.text for c in offline]
    assert metric(server, "pagedserve:num_requests_running_max") > 1
    wait_idle(server)
    assert metric(server, "pagedserve:kv_blocks_used") == 0
    assert metric(server, "pagedserve:kv_cache_usage_perc") == 0


def test_cancelled_grpc_stream_frees_its_blocks_and_the_next_request_succeeds(server):
    wait_idle(server)
    results, error = stream_request(
        server, llm_inputs("Tell me a very long story:", max_tokens=800, ignore_eos=True), cancel_after=3
    )
    assert error is None and len(results) == 3
    wait_idle(server, timeout=10)  # well within a few engine steps
    assert metric(server, "pagedserve:kv_blocks_used") == 0
    assert LLMClient(server.grpc_url).generate("Hi", max_tokens=4, temperature=0)


def test_closed_http_generate_stream_frees_its_blocks(server):
    wait_idle(server)
    body = {"text_input": "Tell me a very long story:", "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 800, "ignore_eos": True})}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate_stream", data=json.dumps(body).encode())
    response = urllib.request.urlopen(request, timeout=60)
    seen = 0
    for line in response:
        seen += line.startswith(b"data:")
        if seen == 3:
            break
    assert metric(server, "pagedserve:num_requests_running") >= 0
    response.close()
    wait_idle(server, timeout=10)
    assert metric(server, "pagedserve:kv_blocks_used") == 0


def test_token_counters_and_latency_histograms_are_exported(server):
    wait_idle(server)
    time.sleep(0.5)  # let the sender count what earlier (cancelled) requests produced
    before = metric(server, "vllm:generation_tokens_total")
    LLMClient(server.grpc_url).generate("Count to five:", max_tokens=5, temperature=0, ignore_eos=True)
    time.sleep(0.3)
    assert metric(server, "vllm:generation_tokens_total") - before == 5
    assert metric(server, "vllm:prompt_tokens_total") > 0
    assert metric(server, "vllm:time_to_first_token_seconds_count") > 0
    assert metric(server, "vllm:e2e_request_latency_seconds_count") > 0
    assert metric(server, "pagedserve:kv_blocks_total") > 0
