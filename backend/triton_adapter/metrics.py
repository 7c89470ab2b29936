"""The engine's Prometheus metrics on Triton's metrics port.

Three groups:
- vLLM's families (`vllm:` counters and histograms) with the names, buckets and
  per-request meaning of Triton's vLLM backend, so its dashboards work unchanged.
  Like there, they are off unless the model parameter `REPORT_CUSTOM_METRICS` is
  true.
- pagedserve's gauges of the KV cache, the queues and engine recoveries, always
  on (an autoscaler and our own tests read them).
- TensorRT-LLM backend's `nv_trt_llm_*` gauge families (request, KV cache block,
  in-flight batcher, general) with its label sets, always on.
- vLLM's model-server gauges (requests running and waiting, KV-cache usage, the cache's
  configuration; the LoRA adapters running and waiting, with LoRA on), always on:
  LLM-aware routers and the Gateway API Inference Extension's endpoint picker rank a
  pagedserve replica by them as they rank a vLLM pod.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from ..outputs import EngineStats, RequestOutput

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class RequestTiming:
    """When a request arrived and released its first and latest tokens (monotonic s; 0.0: not yet)."""

    arrival: float
    first_token: float = 0.0
    last_token: float = 0.0


class _Families:
    """Creates metrics and keeps their families referenced for as long as the metrics
    live: a family collected first makes every later update fail (and the load with it)."""

    def __init__(self, pb_utils: Any, labels: Mapping[str, str]):
        self.pb_utils, self.labels = pb_utils, dict(labels)
        self.families: list[Any] = []

    def metric(self, name: str, description: str, kind: str, buckets: Sequence[float] | None = None,
               labels: Mapping[str, str] | None = None) -> Any:
        """One metric labelled with the model's labels (and `labels`, where given)."""
        family = self.pb_utils.MetricFamily(
            name=name, description=description, kind=getattr(self.pb_utils.MetricFamily, kind)
        )
        self.families.append(family)
        labels = {**self.labels, **(labels or {})}
        if buckets is not None:
            return family.Metric(labels=labels, buckets=buckets)
        return family.Metric(labels=labels)

    def series(self, name: str, description: str, kind: str) -> Callable[[Mapping[str, str]], Any]:
        """One family whose series are made as their labels appear: call the result with a label set."""
        family = self.pb_utils.MetricFamily(name=name, description=description, kind=getattr(self.pb_utils.MetricFamily, kind))
        self.families.append(family)
        return lambda labels: family.Metric(labels={**self.labels, **labels})

    def labelled(
        self, name: str, description: str, label: str, values: tuple[str, ...], labels: Mapping[str, str],
        kind: str = "GAUGE",
    ) -> dict[str, Any]:
        """One family (a gauge unless told) with a series per value of `label` (TensorRT-LLM's layout)."""
        family = self.pb_utils.MetricFamily(name=name, description=description, kind=getattr(self.pb_utils.MetricFamily, kind))
        self.families.append(family)
        return {value: family.Metric(labels={**labels, label: value}) for value in values}


class TrtllmMetrics:
    """TensorRT-LLM backend's gauge families and label sets, so its Grafana dashboards
    work unchanged. Labelled model="tensorrt_llm" (the model name those dashboards
    filter on, and our model of that name relays to this engine)."""

    FAMILIES = {
        "request": ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type",
                    ("active", "max", "scheduled", "context", "waiting")),
        "kv": ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type",
               ("max", "free", "used", "tokens_per", "reused", "fraction")),
        "batcher": ("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
                    "inflight_batcher_specific_metric", ("total_context_tokens", "generation_requests", "micro_batch_id",
                                                         "paused_requests")),
        "general": ("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type", ("timestamp", "iteration_counter")),
    }

    def __init__(self, families: _Families, version: str, max_num_seqs: int):
        labels = {"model": "tensorrt_llm", "version": version}
        self.series = {key: families.labelled(*spec, labels=labels) for key, spec in self.FAMILIES.items()}
        self.max_num_seqs = max_num_seqs

    def refresh(self, stats: EngineStats, now_s: float) -> None:
        step = stats.last_step
        values: dict[str, dict[str, float]] = {
            "request": {"active": stats.num_running + stats.num_waiting, "max": self.max_num_seqs,
                        "scheduled": step.context_requests + step.generation_requests,
                        "context": step.context_requests, "waiting": stats.num_waiting},
            "kv": {"max": stats.kv_blocks_total, "free": stats.kv_blocks_free, "used": stats.kv_blocks_used,
                   "tokens_per": stats.block_size, "reused": stats.prefix_hit_tokens // max(stats.block_size, 1),
                   "fraction": stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0},
            "batcher": {"total_context_tokens": step.context_tokens, "generation_requests": step.generation_requests,
                        "micro_batch_id": 0, "paused_requests": 0},
            "general": {"timestamp": int(now_s * 1e6), "iteration_counter": step.iteration},
        }
        for key, series in self.series.items():
            for value, metric in series.items():
                metric.set(values[key][value])


class ModelServerGauges:
    """vLLM's gauges of the Gateway API Inference Extension's model server protocol, labelled with
    vLLM's `model_name` too: waiting and running requests, KV-cache usage (0-1; under its v1 name and
    its older `gpu_cache_usage_perc`, which older pickers read), `cache_config_info` (1, with the
    block size and block count as labels, which prefix-cache scorers read) and, with LoRA on,
    `lora_requests_info` (the adapters running and waiting and max_lora as labels, the time of the
    latest refresh as its value: endpoint pickers send an adapter's requests where it is loaded)."""

    def __init__(self, families: _Families, model_name: str):
        self._families, self._labels = families, {"model_name": model_name}
        self.waiting = families.metric("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                       "GAUGE", labels=self._labels)
        self.running = families.metric("vllm:num_requests_running", "Number of requests in model execution batches.",
                                       "GAUGE", labels=self._labels)
        self.usage = [families.metric(name, "KV-cache usage. 1 means 100 percent usage.", "GAUGE", labels=self._labels)
                      for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]
        self.cache_config: Any = None
        self._lora_series: Callable[[Mapping[str, str]], Any] | None = None
        self.lora_info: dict[tuple[str, str, str], Any] = {}

    def refresh(self, stats: EngineStats) -> None:
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        for gauge in self.usage:
            gauge.set(stats.kv_usage)
        if self.cache_config is None:  # its labels are the cache's, known from the first stats on
            self.cache_config = self._families.metric(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "GAUGE",
                labels={**self._labels, "block_size": str(stats.block_size), "num_gpu_blocks": str(stats.kv_blocks_total)})
            self.cache_config.set(1)
        if stats.max_lora:
            self._refresh_lora(stats)

    def _refresh_lora(self, stats: EngineStats) -> None:
        """The series of the current adapters set to now. As in vLLM, a label set once seen stays (a
        Triton metric lives as long as its family), with the time it was last current: pickers read
        the newest series."""
        key = (",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters), str(stats.max_lora))
        if key not in self.lora_info:
            if self._lora_series is None:
                self._lora_series = self._families.series("vllm:lora_requests_info", "Running stats on lora requests.",
                                                          "GAUGE")
            self.lora_info[key] = self._lora_series(dict(zip(("running_lora_adapters", "waiting_lora_adapters",
                                                              "max_lora"), key)))
        self.lora_info[key].set(time.time())


class SpecDecodeMetrics:
    """vLLM v1's speculative decoding counters (`vllm:spec_decode_*`), counted up from the
    engine's running totals (EngineStats.spec_*): `counters` by EngineMetrics with its own, the
    per-position family here."""

    STATS = {"spec_num_drafts": ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts."),
             "spec_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens."),
             "spec_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.")}

    def __init__(self, families: _Families, labels: Mapping[str, str], num_speculative_tokens: int):
        self.counters = {key: families.metric(name, text, "COUNTER") for key, (name, text) in self.STATS.items()}
        self.per_pos = families.labelled(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.", "position",
            tuple(str(i) for i in range(num_speculative_tokens)), labels, kind="COUNTER")
        self._seen_pos = [0] * num_speculative_tokens

    def refresh(self, stats: EngineStats) -> None:
        for position, total in enumerate(stats.spec_accepted_per_pos[: len(self._seen_pos)]):
            if total > self._seen_pos[position]:
                self.per_pos[str(position)].increment(total - self._seen_pos[position])
                self._seen_pos[position] = total


class VllmMetrics:
    """Triton's vLLM backend's families: token counters, and per-request histograms
    observed as it does (TTFT once per request; time per output token between
    consecutive token releases; latency, token counts and `n` when a request finishes)."""

    def __init__(self, families: _Families, max_model_len: int):
        metric = families.metric
        self.prompt_tokens = metric("vllm:prompt_tokens_total", "Number of prefill tokens processed.", "COUNTER")
        self.generation_tokens = metric(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", "COUNTER"
        )
        self.ttft = metric("vllm:time_to_first_token_seconds",
                           "Histogram of time to first token in seconds.", "HISTOGRAM", TTFT_BUCKETS)
        self.tpot = metric("vllm:time_per_output_token_seconds",
                           "Histogram of time per output token in seconds.", "HISTOGRAM", TPOT_BUCKETS)
        self.e2e = metric("vllm:e2e_request_latency_seconds",
                          "Histogram of end to end request latency in seconds.", "HISTOGRAM", E2E_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = metric(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", "HISTOGRAM", token_buckets
        )
        self.request_generation_tokens = metric(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", "HISTOGRAM", token_buckets
        )
        self.request_n = metric("vllm:request_params_n", "Histogram of the n request parameter.", "HISTOGRAM", N_BUCKETS)

    def on_output(self, output: RequestOutput, timing: RequestTiming, n: int, now: float) -> None:
        new_tokens = output.num_new_tokens
        if new_tokens:
            if not timing.first_token:
                self.ttft.observe(now - timing.arrival)
                self.prompt_tokens.increment(output.num_prompt_tokens)
            else:
                self.tpot.observe(now - timing.last_token)
            self.generation_tokens.increment(new_tokens)
        if output.finished:
            self.e2e.observe(now - timing.arrival)
            self.request_prompt_tokens.observe(output.num_prompt_tokens)
            self.request_generation_tokens.observe(output.num_output_tokens)
            self.request_n.observe(n)


class EngineMetrics:
    """pagedserve's gauges (always), vLLM's families (`vllm` set: REPORT_CUSTOM_METRICS)."""

    def __init__(
        self, pb_utils: Any, labels: Mapping[str, str], vllm: bool = True, max_model_len: int = 2048, max_num_seqs: int = 64,
        num_speculative_tokens: int = 0,
    ):
        """num_speculative_tokens > 0 (speculative_config): vLLM's spec_decode counters too, with its families,
        and pagedserve's draft-length back-off (always)."""
        self._families = _Families(pb_utils, labels)
        metric = self._families.metric
        self.vllm = VllmMetrics(self._families, max_model_len) if vllm else None
        self.spec_decode = (SpecDecodeMetrics(self._families, labels, num_speculative_tokens)
                            if vllm and num_speculative_tokens > 0 else None)
        self.trtllm = TrtllmMetrics(self._families, str(labels.get("version", "1")), max_num_seqs)
        self.model_server = ModelServerGauges(self._families, str(labels.get("model", "llm")))
        self.running = metric("pagedserve:num_requests_running", "Requests running", "GAUGE")
        self.waiting = metric("pagedserve:num_requests_waiting", "Requests waiting", "GAUGE")
        self.usage = metric("pagedserve:kv_cache_usage_perc", "KV cache usage (0-1; CPU or GPU)", "GAUGE")
        self.blocks_used = metric("pagedserve:kv_blocks_used", "KV blocks used", "GAUGE")
        self.blocks_free = metric("pagedserve:kv_blocks_free", "KV blocks free", "GAUGE")
        self.blocks_total = metric("pagedserve:kv_blocks_total", "KV blocks in the cache", "GAUGE")
        self.hit_rate = metric("pagedserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0-1)", "GAUGE")
        self.max_running = metric("pagedserve:num_requests_running_max", "Most requests seen running at once", "GAUGE")
        self.preemptions = metric("pagedserve:num_preemptions_total", "Requests preempted for KV blocks", "COUNTER")
        self.ready = metric(
            "pagedserve:engine_ready", "1 while the engine serves; 0 once its recovery failed or while a step hangs", "GAUGE"
        )
        self.recoveries = metric(
            "pagedserve:engine_recoveries_total", "Engine steps that failed and were recovered from", "COUNTER"
        )
        self.prefix_queries = metric(
            "pagedserve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", "COUNTER"
        )
        self.prefix_hits = metric(
            "pagedserve:prefix_cache_hits_total", "Prompt tokens whose KV blocks were reused", "COUNTER"
        )
        speculating = num_speculative_tokens > 0
        self.spec_backed_off = metric(
            "pagedserve:spec_decode_backed_off_total",
            "Request-steps that drafted nothing because their drafts were not expected to pay for their rows", "COUNTER",
        ) if speculating else None
        self.spec_row_cost = metric(
            "pagedserve:spec_decode_row_cost_ratio",
            "What one more token row adds to a plain step's time at the current batch size, relative to it", "GAUGE",
        ) if speculating else None
        self._counters = {"num_preemptions": self.preemptions, "num_recoveries": self.recoveries,
                          "prefix_query_tokens": self.prefix_queries, "prefix_hit_tokens": self.prefix_hits,
                          **(self.spec_decode.counters if self.spec_decode is not None else {}),
                          **({"spec_num_backed_off": self.spec_backed_off} if self.spec_backed_off is not None else {})}
        self._seen = dict.fromkeys(self._counters, 0)

    @property
    def families(self) -> list[Any]:
        return self._families.families

    def on_output(self, output: RequestOutput, timing: RequestTiming, n: int, now: float) -> None:
        """Count one engine output of a request with `n` samples; `timing` moves on with it.
        An output that ends a request with an error or an abort counts nothing (as in vLLM)."""
        ended_badly = output.error is not None or output.finish_reason == "abort"
        if self.vllm is not None and not ended_badly:
            self.vllm.on_output(output, timing, n, now)
        if output.num_new_tokens:
            timing.first_token = timing.first_token or now
            timing.last_token = now

    def refresh(self, stats: EngineStats, ready: bool = True) -> None:
        """Set the gauges from the engine's stats; the counters count up by what is new."""
        self.ready.set(1 if ready else 0)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.usage.set(stats.kv_usage)
        self.blocks_used.set(stats.kv_blocks_used)
        self.blocks_free.set(stats.kv_blocks_free)
        self.blocks_total.set(stats.kv_blocks_total)
        self.hit_rate.set(stats.prefix_hit_rate)
        self.max_running.set(stats.peak_num_running)
        self.trtllm.refresh(stats, time.time())
        self.model_server.refresh(stats)
        if self.spec_decode is not None:
            self.spec_decode.refresh(stats)
        if self.spec_row_cost is not None:
            self.spec_row_cost.set(stats.spec_row_cost)
        for name, counter in self._counters.items():
            total = getattr(stats, name)
            if total > self._seen[name]:
                counter.increment(total - self._seen[name])
                self._seen[name] = total
