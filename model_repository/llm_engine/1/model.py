"""Triton model `llm_engine`: decoupled; token ids in, token ids out.

execute() only parses and hands requests to the engine thread, then returns.
Three threads of our own: the engine loop (EngineThread), a sender that turns
engine outputs into responses (so sending never slows a step), and a watcher
that aborts cancelled requests and refreshes the gauges.
"""

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from pagedserve.backend import EngineConfig, LLMEngine
from pagedserve.backend.engine_thread import EngineThread
from pagedserve.backend.errors import EngineDeadError, InvalidRequestError, QueueFullError
from pagedserve.backend.outputs import RequestOutput
from pagedserve.backend.triton_glue import model_parameters, request_inputs, to_tensors
from pagedserve.backend.triton_protocol import EngineRequest, engine_response, merge_outputs, parse_engine_request, scalar
from pagedserve.backend.values import to_bool

logger = logging.getLogger("pagedserve")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WATCH_INTERVAL_S = 0.02
GAUGE_INTERVAL_S = 0.25


@dataclass
class ActiveRequest:
    sender: object
    request: EngineRequest
    arrival: float
    first_token: float = 0.0
    pending: RequestOutput = None  # a non-streaming request's merged output so far
    abort_sent: bool = False


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        enable_metrics = to_bool(params.pop("enable_metrics", "true"))
        self.engine = LLMEngine(EngineConfig.from_strings(params))
        self.tokenizer = self.engine.tokenizer
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = EngineMetrics(labels) if enable_metrics else None
        self.active: dict[str, ActiveRequest] = {}  # until the final response is sent
        self.lock = threading.Lock()  # a sender's factory is gone once its final response is sent
        self.ids = itertools.count()
        self.outbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.loop = EngineThread(self.engine)
        self.sender = threading.Thread(target=self._send_loop, name="pagedserve-sender", daemon=True)
        self.watcher = threading.Thread(target=self._watch_loop, name="pagedserve-watcher", daemon=True)
        self.sender.start()
        self.watcher.start()

    # -- requests in -------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            inputs = request_inputs(request)
            if "cancel_request_id" in inputs:
                self._cancel(inputs, sender)
                continue
            request_id = request.request_id()
            if not request_id or request_id in self.active:
                request_id = f"{request_id or 'req'}#{next(self.ids)}"
            try:
                parsed = parse_engine_request(inputs, self.tokenizer, request.parameters())
                with self.lock:
                    self.active[request_id] = ActiveRequest(sender, parsed, time.monotonic())
                self.loop.submit(request_id, parsed.prompt_token_ids, parsed.params, self.outbox.put)
            except Exception as error:
                with self.lock:
                    self.active.pop(request_id, None)
                sender.send(pb_utils.InferenceResponse(error=_triton_error(error)), flags=FINAL)
        return None

    def _cancel(self, inputs, sender):
        """A control request: abort the request named by `cancel_request_id`."""
        try:
            target = scalar(inputs, "cancel_request_id")
            with self.lock:
                active = self.active.get(target)
            if active is not None:
                active.abort_sent = True
                self.loop.abort(target)
            sender.send(flags=FINAL)
        except Exception as error:
            sender.send(pb_utils.InferenceResponse(error=_triton_error(error)), flags=FINAL)

    # -- responses out -----------------------------------------------------------
    def _send_loop(self):
        while True:
            output = self.outbox.get()
            if output is None:
                return
            with self.lock:  # the watcher must not ask a finished sender whether it was cancelled
                active = self.active.pop(output.request_id, None) if output.finished else self.active.get(output.request_id)
            if active is None:
                continue
            try:
                self._send(active, output)
            except Exception:
                logger.exception("sending a response for %s failed", output.request_id)

    def _send(self, active: ActiveRequest, output: RequestOutput) -> None:
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_output(active, output, now)
        if output.new_token_ids and not active.first_token:
            active.first_token = now
        if output.error is not None:
            error = pb_utils.TritonError(f"engine failure: {output.error}", pb_utils.TritonError.INTERNAL)
            active.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        if output.finish_reason == "abort":
            error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
            active.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        if not active.request.stream:
            active.pending = output if active.pending is None else merge_outputs(active.pending, output)
            if not output.finished:
                return
            output = active.pending
        tensors = engine_response(active.request, output, self.tokenizer)
        response = pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, tensors))
        active.sender.send(response, flags=FINAL if output.finished else 0)

    # -- cancellation and gauges -------------------------------------------------
    def _watch_loop(self):
        next_gauges = 0.0
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                for request_id, active in self.active.items():
                    if not active.abort_sent and active.sender.is_cancelled():
                        active.abort_sent = True
                        self.loop.abort(request_id)
            if self.metrics is not None and time.monotonic() >= next_gauges:
                self.metrics.refresh(self.engine.stats())
                next_gauges = time.monotonic() + GAUGE_INTERVAL_S

    def finalize(self):
        """Cancel what is in flight (clients get CANCELLED), then join every thread."""
        self.loop.shutdown(timeout=30)
        self.outbox.put(None)
        self.sender.join(30)
        self.stopping.set()
        self.watcher.join(5)


def _triton_error(error: Exception):
    if isinstance(error, InvalidRequestError):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
    if isinstance(error, (QueueFullError, EngineDeadError)):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.UNAVAILABLE)
    return pb_utils.TritonError(f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]


class EngineMetrics:
    """vLLM-named counters and histograms, plus gauges of the KV cache and queues.

    Families are kept referenced for as long as their metrics live: a family
    collected first makes every later update fail."""

    def __init__(self, labels):
        self.families = []
        self.labels = labels
        counter, gauge, histogram = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM
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
        self._preemptions_seen = 0

    def _metric(self, name, description, kind, buckets=None):
        family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self.families.append(family)
        if buckets is not None:
            return family.Metric(labels=self.labels, buckets=buckets)
        return family.Metric(labels=self.labels)

    def on_output(self, active, output, now):
        if output.error is not None:
            return
        if active.first_token == 0.0 and output.new_token_ids:
            self.ttft.observe(now - active.arrival)
            self.prompt_tokens.increment(output.num_prompt_tokens)
        if output.new_token_ids:
            self.generation_tokens.increment(len(output.new_token_ids))
        if output.finished:
            self.e2e.observe(now - active.arrival)
            if output.num_output_tokens > 1 and active.first_token:
                self.tpot.observe((now - active.first_token) / (output.num_output_tokens - 1))

    def refresh(self, stats):
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.usage.set(stats.kv_usage)
        self.blocks_used.set(stats.kv_blocks_used)
        self.blocks_free.set(stats.kv_blocks_free)
        self.blocks_total.set(stats.kv_blocks_total)
        self.hit_rate.set(stats.prefix_hit_rate)
        self.max_running.set(stats.peak_num_running)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.increment(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
