"""EngineMetrics: vLLM's names and buckets, and the values each output adds."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.backend.engine import EngineStats
from pagedserve.backend.outputs import RequestOutput
from pagedserve.backend.triton_adapter.metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, EngineMetrics

from .fakes import FakePbUtils, MetricFamily

LABELS = {"model": "llm_engine", "version": "1"}


@pytest.fixture
def metrics():
    return EngineMetrics(FakePbUtils(), LABELS)


def output(new_ids, finished=False, num_output_tokens=0, error=None):
    return RequestOutput("r", new_ids, [], "", finished, num_prompt_tokens=7, num_output_tokens=num_output_tokens, error=error)


def test_names_kinds_buckets_and_labels(metrics):
    families = {f.name: f for f in metrics.families}
    assert {n for n, f in families.items() if f.kind == MetricFamily.COUNTER} == {
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
        "pagedserve:engine_recoveries_total"}
    assert {n for n, f in families.items() if f.kind == MetricFamily.GAUGE} == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
        "pagedserve:kv_blocks_used", "pagedserve:kv_blocks_free", "pagedserve:kv_blocks_total",
        "pagedserve:prefix_cache_hit_rate", "pagedserve:num_requests_running_max"}
    assert (metrics.ttft.buckets, metrics.tpot.buckets, metrics.e2e.buckets) == (TTFT_BUCKETS, TPOT_BUCKETS, E2E_BUCKETS)
    assert metrics.ttft.family.name == "vllm:time_to_first_token_seconds"
    assert metrics.tpot.family.name == "vllm:time_per_output_token_seconds"
    assert metrics.e2e.family.name == "vllm:e2e_request_latency_seconds"
    every_metric = [v for v in vars(metrics).values() if hasattr(v, "family")]
    assert len(every_metric) == 15 and all(m.labels == LABELS for m in every_metric)
    assert all(m.family in metrics.families for m in every_metric)  # families outlive their metrics


def test_a_request_observes_ttft_tpot_and_e2e(metrics):
    arrival, first = 100.0, 100.25
    metrics.on_output(output([1, 2]), arrival, 0.0, first)
    metrics.on_output(output([3], num_output_tokens=3), arrival, first, 100.5)
    metrics.on_output(output([4], finished=True, num_output_tokens=4), arrival, first, 101.0)
    assert metrics.ttft.observations == [pytest.approx(0.25)]
    assert metrics.prompt_tokens.total == 7
    assert metrics.generation_tokens.total == 4
    assert metrics.e2e.observations == [pytest.approx(1.0)]
    assert metrics.tpot.observations == [pytest.approx(0.75 / 3)]


def test_one_token_request_has_no_tpot_and_failures_count_nothing(metrics):
    metrics.on_output(output([1], finished=True, num_output_tokens=1), 0.0, 0.0, 0.5)
    assert metrics.tpot.observations == [] and metrics.e2e.observations == [0.5]
    metrics.on_output(output([], finished=True, error="boom"), 0.0, 0.0, 9.0)
    assert metrics.e2e.observations == [0.5] and metrics.generation_tokens.total == 1


def test_refresh_sets_gauges_and_counts_new_preemptions_and_recoveries_once(metrics):
    stats = EngineStats(num_running=2, num_waiting=1, peak_num_running=5, kv_blocks_total=64, kv_blocks_used=16,
                        kv_blocks_free=48, kv_usage=0.25, prefix_hit_rate=0.5, num_preemptions=3,
                        prompt_tokens=0, generation_tokens=0)
    metrics.refresh(stats)
    metrics.refresh(stats)
    assert metrics.preemptions.total == 3
    metrics.refresh(dataclasses.replace(stats, num_preemptions=5, num_recoveries=1))
    metrics.refresh(dataclasses.replace(stats, num_preemptions=5, num_recoveries=1))
    assert metrics.preemptions.total == 5 and metrics.recoveries.total == 1
    assert (metrics.running.total, metrics.waiting.total, metrics.usage.total) == (2, 1, 0.25)
    assert (metrics.blocks_used.total, metrics.blocks_free.total, metrics.blocks_total.total) == (16, 48, 64)
    assert (metrics.hit_rate.total, metrics.max_running.total) == (0.5, 5)
