"""`llm_engine`'s Prometheus metrics on Triton's metrics port.

vLLM's names, buckets and meanings, so dashboards built for Triton's vLLM backend
work unchanged; plus pagedserve gauges of the KV cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from ..engine import EngineStats
    from ..outputs import RequestOutput

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]


class EngineMetrics:
    """vLLM-named counters and histograms, plus gauges of the KV cache and queues.

    Families are kept referenced for as long as their metrics live: a family
    collected first makes every later update fail (and the model load with it)."""

    def __init__(self, pb_utils: Any, labels: Mapping[str, str]):
        self.pb_utils = pb_utils
        self.families: list[Any] = []
        self.labels = dict(labels)
        family = pb_utils.MetricFamily
        counter, gauge, histogram = family.COUNTER, family.GAUGE, family.HISTOGRAM
        self.prompt_tokens = self._metric("vllm:prompt_tokens_total", "Prompt tokens processed", counter)
        self.generation_tokens = self._metric("vllm:generation_tokens_total", "Tokens generated", counter)
        self.preemptions = self._metric("vllm:num_preemptions_total", "Requests preempted for KV blocks", counter)
        self.ttft = self._metric("vllm:time_to_first_token_seconds", "Time to first token", histogram, TTFT_BUCKETS)
        self.tpot = self._metric("vllm:time_per_output_token_seconds", "Time per output token", histogram, TPOT_BUCKETS)
        self.e2e = self._metric("vllm:e2e_request_latency_seconds", "End-to-end request latency", histogram, E2E_BUCKETS)
        self.running = self._metric("vllm:num_requests_running", "Requests running", gauge)
        self.waiting = self._metric("vllm:num_requests_waiting", "Requests waiting", gauge)
        self.usage = self._metric("vllm:gpu_cache_usage_perc", "KV cache usage (0-1; CPU or GPU)", gauge)
        self.blocks_used = self._metric("pagedserve:kv_blocks_used", "KV blocks used", gauge)
        self.blocks_free = self._metric("pagedserve:kv_blocks_free", "KV blocks free", gauge)
        self.blocks_total = self._metric("pagedserve:kv_blocks_total", "KV blocks in the cache", gauge)
        self.hit_rate = self._metric("pagedserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0-1)", gauge)
        self.max_running = self._metric("pagedserve:num_requests_running_max", "Most requests seen running at once", gauge)
        self.recoveries = self._metric(
            "pagedserve:engine_recoveries_total", "Engine steps that failed and were recovered from", counter
        )
        self._seen = {"num_preemptions": 0, "num_recoveries": 0}

    def _metric(self, name: str, description: str, kind: Any, buckets: list[float] | None = None) -> Any:
        family = self.pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self.families.append(family)
        if buckets is not None:
            return family.Metric(labels=self.labels, buckets=buckets)
        return family.Metric(labels=self.labels)

    def on_output(self, output: RequestOutput, arrival: float, first_token: float, now: float) -> None:
        """Count one engine output of a request that arrived at `arrival` and released
        its first token at `first_token` (0.0: not yet, so this output's tokens are the first)."""
        if output.error is not None:
            return
        if first_token == 0.0 and output.new_token_ids:
            self.ttft.observe(now - arrival)
            self.prompt_tokens.increment(output.num_prompt_tokens)
        if output.new_token_ids:
            self.generation_tokens.increment(len(output.new_token_ids))
        if output.finished:
            self.e2e.observe(now - arrival)
            if output.num_output_tokens > 1 and first_token:
                self.tpot.observe((now - first_token) / (output.num_output_tokens - 1))

    def refresh(self, stats: EngineStats) -> None:
        """Set the gauges from the engine's stats; the counters count up by what is new."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.usage.set(stats.kv_usage)
        self.blocks_used.set(stats.kv_blocks_used)
        self.blocks_free.set(stats.kv_blocks_free)
        self.blocks_total.set(stats.kv_blocks_total)
        self.hit_rate.set(stats.prefix_hit_rate)
        self.max_running.set(stats.peak_num_running)
        for name, counter in (("num_preemptions", self.preemptions), ("num_recoveries", self.recoveries)):
            total = getattr(stats, name)
            if total > self._seen[name]:
                counter.increment(total - self._seen[name])
                self._seen[name] = total
