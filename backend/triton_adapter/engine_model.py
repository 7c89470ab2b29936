"""The `llm_engine` model: decoupled; token ids in, token ids out.

execute() only parses and hands requests to the engine thread, then returns.
Besides the engine thread, two threads of our own: the response thread turns
engine outputs into Triton responses (so sending never slows an engine step),
and the watcher aborts requests whose client cancelled and refreshes the gauges.

Triton trap kept here: once a request's final response is sent its response
sender is gone in the server, and `is_cancelled()` on it is a use-after-free. So
a request leaves `active` (under `lock`) before its final response goes out,
and the watcher only asks senders that are still in `active`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..config import EngineConfig
from ..engine import EngineStats, LLMEngine
from ..engine_thread import EngineThread
from ..outputs import RequestOutput
from ..values import to_bool
from .arguments import model_parameters
from .metrics import EngineMetrics
from .requests import EngineRequest, parse_engine_request
from .responses import engine_response, merge_outputs, triton_error
from .tensors import Arrays, request_inputs, scalar, to_tensors

logger = logging.getLogger("pagedserve")
WATCH_INTERVAL_S = 0.02
GAUGE_INTERVAL_S = 0.25


@dataclass
class ActiveRequest:
    """A request from its submit until its final response is sent."""

    response_sender: Any
    request: EngineRequest
    arrival: float
    first_token: float = 0.0
    pending: RequestOutput | None = None
    """A non-streaming request's merged output so far."""
    abort_sent: bool = False


class EngineModel:
    """Per-request lifecycle of `llm_engine` over an EngineThread.

    `engine_thread` needs submit(request_id, prompt_token_ids, params, on_output),
    abort(request_id) and shutdown(timeout); `stats` returns the engine's EngineStats
    (read for the gauges only when `metrics` is given).
    """

    def __init__(
        self,
        pb_utils: Any,
        engine_thread: Any,
        tokenizer: Any,
        stats: Callable[[], EngineStats],
        metrics: EngineMetrics | None = None,
    ):
        self.pb_utils = pb_utils
        self.final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.engine_thread = engine_thread
        self.tokenizer = tokenizer
        self.stats = stats
        self.metrics = metrics
        self.active: dict[str, ActiveRequest] = {}  # until the final response is sent
        self.lock = threading.Lock()  # a sender's factory is gone once its final response is sent
        self.ids = itertools.count()
        self.outbox: queue.Queue[RequestOutput | None] = queue.Queue()
        self.stopping = threading.Event()
        self.response_thread = threading.Thread(target=self._response_loop, name="pagedserve-responses", daemon=True)
        self.watcher_thread = threading.Thread(target=self._watch_loop, name="pagedserve-watcher", daemon=True)
        self.response_thread.start()
        self.watcher_thread.start()

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> EngineModel:
        """Load the engine that config.pbtxt's parameters describe (Triton's initialize args)."""
        params = model_parameters(args)
        enable_metrics = to_bool(params.pop("enable_metrics", "true"))
        engine = LLMEngine(EngineConfig.from_strings(params))
        labels = {"model": args["model_name"], "version": args["model_version"]}
        metrics = EngineMetrics(pb_utils, labels) if enable_metrics else None
        return cls(pb_utils, EngineThread(engine), engine.tokenizer, engine.stats, metrics)

    # -- requests in -------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        """Submit each request (or apply a cancel control request); responses follow on the response thread."""
        for request in requests:
            response_sender = request.get_response_sender()
            inputs = request_inputs(request)
            if "cancel_request_id" in inputs:
                self._cancel(inputs, response_sender)
                continue
            request_id = request.request_id()
            if not request_id or request_id in self.active:
                request_id = f"{request_id or 'req'}#{next(self.ids)}"
            try:
                parsed = parse_engine_request(inputs, self.tokenizer, request.parameters())
                with self.lock:
                    self.active[request_id] = ActiveRequest(response_sender, parsed, time.monotonic())
                self.engine_thread.submit(request_id, parsed.prompt_token_ids, parsed.params, self.outbox.put)
            except Exception as error:
                with self.lock:
                    self.active.pop(request_id, None)
                self._send_error(response_sender, triton_error(self.pb_utils, error))
        return None

    def _cancel(self, inputs: Arrays, response_sender: Any) -> None:
        """A control request (how `llm` forwards a client's cancellation): abort the
        request named by `cancel_request_id`, then answer with an empty final."""
        try:
            target = scalar(inputs, "cancel_request_id")
            with self.lock:
                active = self.active.get(target)
            if active is not None:
                active.abort_sent = True
                self.engine_thread.abort(target)
            response_sender.send(flags=self.final_flag)
        except Exception as error:
            self._send_error(response_sender, triton_error(self.pb_utils, error))

    # -- responses out -------------------------------------------------------------
    def _response_loop(self) -> None:
        while True:
            output = self.outbox.get()
            if output is None:
                return
            with self.lock:  # the watcher must not ask a finished sender whether it was cancelled
                active = self.active.pop(output.request_id, None) if output.finished else self.active.get(output.request_id)
            if active is None:
                continue
            try:
                self._respond(active, output)
            except Exception:
                logger.exception("sending a response for %s failed", output.request_id)

    def _respond(self, active: ActiveRequest, output: RequestOutput) -> None:
        """Streaming: one response per output, final flag on the last. Otherwise one merged response."""
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_output(output, active.arrival, active.first_token, now)
        if output.new_token_ids and not active.first_token:
            active.first_token = now
        codes = self.pb_utils.TritonError
        if output.error is not None:
            self._send_error(active.response_sender, codes(f"engine failure: {output.error}", codes.INTERNAL))
            return
        if output.finish_reason == "abort":
            self._send_error(active.response_sender, codes("request cancelled", codes.CANCELLED))
            return
        if not active.request.stream:
            active.pending = output if active.pending is None else merge_outputs(active.pending, output)
            if not output.finished:
                return
            output = active.pending
        tensors = engine_response(active.request, output, self.tokenizer)
        response = self.pb_utils.InferenceResponse(output_tensors=to_tensors(self.pb_utils, tensors))
        active.response_sender.send(response, flags=self.final_flag if output.finished else 0)

    def _send_error(self, response_sender: Any, error: Any) -> None:
        response_sender.send(self.pb_utils.InferenceResponse(error=error), flags=self.final_flag)

    # -- cancellation and gauges ---------------------------------------------------
    def _watch_loop(self) -> None:
        next_gauges = 0.0
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                for request_id, active in self.active.items():
                    if not active.abort_sent and active.response_sender.is_cancelled():
                        active.abort_sent = True
                        self.engine_thread.abort(request_id)
            if self.metrics is not None and time.monotonic() >= next_gauges:
                self.metrics.refresh(self.stats())
                next_gauges = time.monotonic() + GAUGE_INTERVAL_S

    def finalize(self) -> None:
        """Cancel what is in flight (clients get CANCELLED), then join every thread."""
        self.engine_thread.shutdown(timeout=30)
        self.outbox.put(None)
        self.response_thread.join(30)
        self.stopping.set()
        self.watcher_thread.join(5)
