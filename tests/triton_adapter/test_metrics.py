"""EngineMetrics: vLLM's names and buckets, and the values each output adds."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pagedserve.backend.outputs import EngineStats, StepCounts
from pagedserve.backend.outputs import RequestOutput
from pagedserve.backend.triton_adapter.metrics import (
    E2E_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    EngineMetrics,
    RequestTiming,
)

from .fakes import FakePbUtils, MetricFamily

LABELS = {"model": "llm_engine", "version": "1"}


@pytest.fixture
def metrics():
    return EngineMetrics(FakePbUtils(), LABELS, vllm=True, max_model_len=1000)


def output(new_ids, finished=False, num_output_tokens=0, error=None, finish_reason=None):
    return RequestOutput("r", new_ids, [], "", finished, finish_reason=finish_reason, num_prompt_tokens=7,
                         num_output_tokens=num_output_tokens, error=error)


def test_names_kinds_buckets_and_labels(metrics):
    families = {f.name: f for f in metrics.families}
    assert {n for n, f in families.items() if f.kind == MetricFamily.COUNTER} == {
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "pagedserve:num_preemptions_total",
        "pagedserve:engine_recoveries_total", "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total"}
    assert {n for n, f in families.items() if f.kind == MetricFamily.GAUGE} == {
        "pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc",
        "pagedserve:kv_blocks_used", "pagedserve:kv_blocks_free", "pagedserve:kv_blocks_total",
        "pagedserve:prefix_cache_hit_rate", "pagedserve:num_requests_running_max", "pagedserve:engine_ready",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_inflight_batcher_metrics", "nv_trt_llm_general_metrics"}
    vllm = metrics.vllm
    assert {n for n, f in families.items() if f.kind == MetricFamily.HISTOGRAM} == {
        "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n"}
    assert (vllm.ttft.buckets, vllm.tpot.buckets, vllm.e2e.buckets) == (TTFT_BUCKETS, TPOT_BUCKETS, E2E_BUCKETS)
    assert vllm.e2e.buckets == [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert vllm.request_prompt_tokens.buckets == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert vllm.request_n.buckets == [1, 2, 5, 10, 20]
    every_metric = [v for v in [*vars(metrics).values(), *vars(vllm).values()] if hasattr(v, "family")]
    assert len(every_metric) == 21 and all(m.labels == LABELS for m in every_metric)
    assert all(m.family in metrics.families for m in every_metric)  # families outlive their metrics


def test_without_report_custom_metrics_only_the_model_server_gauges_are_vllm_named():
    metrics = EngineMetrics(FakePbUtils(), LABELS, vllm=False)
    assert metrics.vllm is None
    assert {f.name for f in metrics.families if f.name.startswith("vllm:")} == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
    metrics.on_output(output([1], finished=True, num_output_tokens=1), RequestTiming(0.0), 1, 1.0)


def test_a_request_observes_ttft_once_tpot_per_release_and_its_totals_at_the_end(metrics):
    timing = RequestTiming(arrival=100.0)
    metrics.on_output(output([1, 2]), timing, 1, 100.25)
    metrics.on_output(output([]), timing, 1, 100.3)  # nothing released: no observation
    metrics.on_output(output([3], num_output_tokens=3), timing, 1, 100.5)
    metrics.on_output(output([4], finished=True, num_output_tokens=4, finish_reason="length"), timing, 1, 101.0)
    vllm = metrics.vllm
    assert vllm.ttft.observations == [pytest.approx(0.25)]
    assert vllm.prompt_tokens.total == 7 and vllm.generation_tokens.total == 4
    assert vllm.tpot.observations == [pytest.approx(0.25), pytest.approx(0.5)]
    assert vllm.e2e.observations == [pytest.approx(1.0)]
    assert (vllm.request_prompt_tokens.observations, vllm.request_generation_tokens.observations) == ([7], [4])
    assert vllm.request_n.observations == [1]


def test_n_samples_count_every_samples_tokens_and_observe_n_once(metrics):
    samples = [output([1, 2], num_output_tokens=2), output([3], num_output_tokens=1)]
    merged = RequestOutput("r", [], [], "", True, "length", num_prompt_tokens=7, num_output_tokens=3, samples=samples)
    metrics.on_output(merged, RequestTiming(0.0), 2, 0.5)
    assert metrics.vllm.generation_tokens.total == 3
    assert metrics.vllm.request_generation_tokens.observations == [3] and metrics.vllm.request_n.observations == [2]


def test_cancelled_and_failed_requests_are_not_counted_as_finished(metrics):
    metrics.on_output(output([], finished=True, finish_reason="abort"), RequestTiming(0.0), 1, 2.0)
    metrics.on_output(output([], finished=True, error="boom"), RequestTiming(0.0), 1, 9.0)
    assert metrics.vllm.e2e.observations == [] and metrics.vllm.request_n.observations == []


def test_refresh_sets_gauges_and_counts_new_preemptions_and_recoveries_once(metrics):
    stats = EngineStats(num_running=2, num_waiting=1, peak_num_running=5, kv_blocks_total=64, kv_blocks_used=16,
                        kv_blocks_free=48, kv_usage=0.25, prefix_hit_rate=0.5, num_preemptions=3,
                        prompt_tokens=0, generation_tokens=0)
    metrics.refresh(stats)
    metrics.refresh(stats)
    assert metrics.preemptions.total == 3
    later = dataclasses.replace(stats, num_preemptions=5, num_recoveries=1, prefix_query_tokens=90, prefix_hit_tokens=32)
    metrics.refresh(later)
    metrics.refresh(later)
    assert metrics.preemptions.total == 5 and metrics.recoveries.total == 1
    assert (metrics.prefix_queries.total, metrics.prefix_hits.total) == (90, 32)
    assert (metrics.running.total, metrics.waiting.total, metrics.usage.total) == (2, 1, 0.25)
    assert (metrics.blocks_used.total, metrics.blocks_free.total, metrics.blocks_total.total) == (16, 48, 64)
    assert (metrics.hit_rate.total, metrics.max_running.total) == (0.5, 5)
    assert metrics.ready.total == 1
    metrics.refresh(later, ready=False)  # recovery failed, or a step hangs
    assert metrics.ready.total == 0


def test_tensorrt_llm_families_carry_its_labels_and_the_engines_state():
    metrics = EngineMetrics(FakePbUtils(), LABELS, vllm=False, max_num_seqs=64)
    stats = EngineStats(num_running=3, num_waiting=2, peak_num_running=3, kv_blocks_total=100, kv_blocks_used=25,
                        kv_blocks_free=75, kv_usage=0.25, prefix_hit_rate=0.0, num_preemptions=0, prompt_tokens=0,
                        generation_tokens=0, prefix_hit_tokens=64, block_size=16,
                        last_step=StepCounts(iteration=9, context_requests=1, context_tokens=40, generation_requests=2))
    metrics.refresh(stats)
    series = metrics.trtllm.series
    assert {k: m.total for k, m in series["request"].items()} == {"active": 5, "max": 64, "scheduled": 3, "context": 1, "waiting": 2}
    assert {k: m.total for k, m in series["kv"].items()} == {
        "max": 100, "free": 75, "used": 25, "tokens_per": 16, "reused": 4, "fraction": 0.25}
    assert series["batcher"]["total_context_tokens"].total == 40 and series["general"]["iteration_counter"].total == 9
    assert series["kv"]["used"].labels == {"model": "tensorrt_llm", "version": "1", "kv_cache_block_type": "used"}


def test_the_model_server_protocols_gauges_read_the_engines_state():
    """The Gateway API Inference Extension's endpoint picker (and llm-d's scheduler) rank a pod by
    vllm:num_requests_waiting, vllm:num_requests_running and vllm:kv_cache_usage_perc (0-1; older
    pickers: vllm:gpu_cache_usage_perc), and read the block size from vllm:cache_config_info."""
    metrics = EngineMetrics(FakePbUtils(), LABELS, vllm=False)
    stats = EngineStats(num_running=3, num_waiting=2, peak_num_running=5, kv_blocks_total=400, kv_blocks_used=100,
                        kv_blocks_free=300, kv_usage=0.25, prefix_hit_rate=0.0, num_preemptions=0, prompt_tokens=0,
                        generation_tokens=0, block_size=16)
    metrics.refresh(stats)
    gauges = metrics.model_server
    assert (gauges.waiting.total, gauges.running.total) == (2, 3)
    assert [g.total for g in gauges.usage] == [0.25, 0.25]
    assert gauges.waiting.labels == {**LABELS, "model_name": "llm_engine"}
    info = gauges.cache_config
    assert info.family.name == "vllm:cache_config_info" and info.total == 1
    assert info.labels == {**LABELS, "model_name": "llm_engine", "block_size": "16", "num_gpu_blocks": "400"}
    metrics.refresh(dataclasses.replace(stats, num_waiting=0, kv_usage=0.5))
    assert gauges.waiting.total == 0 and gauges.usage[0].total == 0.5 and gauges.cache_config is info
    assert gauges.lora_info == {}  # LoRA off: no vllm:lora_requests_info


def test_lora_requests_info_names_the_adapters_as_vllm_does(monkeypatch):
    """With LoRA on, vllm:lora_requests_info: the adapters running and waiting (comma-separated) and
    max_lora as labels, the refresh's time as the value; pickers read the newest series, so a label
    set seen before is set again rather than made twice."""
    metrics = EngineMetrics(FakePbUtils(), LABELS, vllm=False)
    stats = EngineStats(num_running=2, num_waiting=1, peak_num_running=2, kv_blocks_total=40, kv_blocks_used=4,
                        kv_blocks_free=36, kv_usage=0.1, prefix_hit_rate=0.0, num_preemptions=0, prompt_tokens=0,
                        generation_tokens=0, max_lora=4, running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",))
    clock = itertools.count(100.0)
    monkeypatch.setattr("pagedserve.backend.triton_adapter.metrics.time.time", lambda: next(clock))
    metrics.refresh(stats)
    busy = metrics.model_server.lora_info[("a,b", "c", "4")]
    assert busy.family.name == "vllm:lora_requests_info" and busy.total >= 100.0
    assert busy.labels == {**LABELS, "running_lora_adapters": "a,b", "waiting_lora_adapters": "c", "max_lora": "4"}
    metrics.refresh(dataclasses.replace(stats, running_lora_adapters=(), waiting_lora_adapters=()))
    idle = metrics.model_server.lora_info[("", "", "4")]
    assert idle.total > busy.total  # the newest says: nothing running
    metrics.refresh(stats)
    assert metrics.model_server.lora_info[("a,b", "c", "4")] is busy and busy.total > idle.total
    assert len({m.family for m in metrics.model_server.lora_info.values()}) == 1
