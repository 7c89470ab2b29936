"""The model that hosts the engine (`llm`): decoupled; the vLLM backend's text
contract in and out, and token ids in and out for the relays (`llm_engine`,
`tensorrt_llm`, `tensorrt_llm_bls`) and for clients that tokenize themselves.

A text request is planned by the model's client contract (contracts.py: prompt to
token ids) and each engine response is rendered by it (ids to a text delta), in this
process: a streamed token crosses one process boundary on its way to the client, not
two as through a relay (that hop cost throughput at 32 streams on 2 cores:
benchmarks/RESULTS.md, "One process hop per streamed token").

execute() only parses and hands requests to the engine thread, then returns.
Besides the engine thread, two threads of our own: the response thread turns
engine outputs into Triton responses (so sending never slows an engine step),
and the watcher aborts requests whose client cancelled and refreshes the gauges.

Past 300 lines on purpose: a request's whole life here (accept, respond, cancel, finish) runs
on three threads that share one lock and the `active` map; split in two, each half would
reach into the other's state.

Triton (2.51) traps kept here:
- once a request's final response is sent its response sender is gone in the
  server, and `is_cancelled()` on it is a use-after-free. So a request leaves
  `active` (under `lock`) before its final response goes out, and the watcher
  only asks senders that are still in `active`.
- every request gets exactly one final, also when building or sending a response
  fails (finals.send_final; a failed non-final send aborts the request).
- a BLS caller (a relay, input `bls_caller`) gets an empty response at once: the
  python backend holds one of its BLS threads (32 by default) per call until
  the first response, and a request waiting in the queue would keep it. Its
  errors travel as data in `error` (finals.py says why).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..config import EngineConfig
from ..engine import LLMEngine
from ..engine_thread import EngineThread
from ..errors import ConfigError, InvalidRequestError
from ..lora.adapter import MULTI_LORA_FILE
from ..outputs import EngineStats, RequestOutput
from ..process_tuning import name_native_thread
from ..values import to_bool
from .arguments import model_parameters
from .cancellation import WATCH_INTERVAL_S, AskRotation, RecentIds, Watcher, asked_cancelled
from .contracts import Contract, RenderedReply, Reply, VllmText
from .finals import CANCELLED, Failure, send_final
from .metrics import EngineMetrics, RequestTiming
from .python_model import log_info
from .requests import BLS_CALLER, EngineRequest, image_input, image_prompt, parse_engine_request
from .responses import CLIENT_OUTPUTS, engine_response, merge_outputs
from .tensors import flag, request_inputs, scalar, to_tensors

logger = logging.getLogger("pagedserve")
GAUGE_INTERVAL_S = 0.25


@dataclass
class ActiveRequest:
    """A request from its submit until its final response is sent."""

    response_sender: Any
    request: EngineRequest
    timing: RequestTiming
    pending: RequestOutput | None = None
    """A non-streaming request's merged output so far."""
    generating: bool = False
    """The engine has sent output for it: it costs steps until it ends (the watcher asks it first)."""
    abort_sent: bool = False
    failure: Failure | None = None
    """Why we aborted it ourselves (a failed send); None: its client cancelled."""
    reply: Reply | None = None
    """The client contract's responses for an engine response; None: the client reads token ids."""
    rendered_reply: RenderedReply | None = None
    """The same from the engine's rendered text, where the contract has it (contracts.RelayPlan)."""


class EngineModel:
    """Per-request lifecycle of the engine-hosting model over an EngineThread.

    `engine_thread` needs submit(request_id, prompt_token_ids, params, on_output, mm), prompt_inputs(prompt)
    (a prompt with images: a vision-language model's `image` input),
    abort(request_id) and shutdown(timeout); `stats` returns the engine's EngineStats
    (read for the gauges only when `metrics` is given). With a `contract` (a subclass
    names it), requests without `input_ids` speak it: text in, text out.
    """

    contract: Contract | None = None

    def __init__(
        self,
        pb_utils: Any,
        engine_thread: Any,
        tokenizer: Any,
        stats: Callable[[], EngineStats],
        metrics: EngineMetrics | None = None,
        model_defaults: Mapping[str, Any] | None = None,
    ):
        self.pb_utils = pb_utils
        self.model_defaults = dict(model_defaults or {})
        """The checkpoint's generation_config sampling fields (requests' `use_model_defaults`)."""
        self.final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.engine_thread = engine_thread
        self.tokenizer = tokenizer
        self.stats = stats
        self.metrics = metrics
        self.active: dict[str, ActiveRequest] = {}  # until the final response is sent
        self.lock = threading.Lock()  # a sender's factory is gone once its final response is sent
        self.outbox: queue.Queue[RequestOutput | None] = queue.Queue()
        self.cancelled_early = RecentIds()  # cancels that came before their request
        self.next_gauges = 0.0
        self.response_thread = threading.Thread(target=self._response_loop, name="pagedserve-responses", daemon=True)
        self.response_thread.start()
        self.asks = AskRotation()
        self.watcher = Watcher("pagedserve-watcher", self._watch, WATCH_INTERVAL_S)

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> EngineModel:
        """Load the engine that config.pbtxt's parameters describe (Triton's initialize args)."""
        params = model_parameters(args)
        enable_metrics = to_bool(params.pop("enable_metrics", "true"))
        # vLLM-named metrics: off unless asked for, as in Triton's vLLM backend
        report_vllm_metrics = to_bool(params.pop("REPORT_CUSTOM_METRICS", "false"))
        if to_bool(params.get("enable_lora", "false")) and not params.get("lora_modules"):
            params["lora_modules"] = beside_the_model(args)
        config = EngineConfig.from_strings(params)
        # built on its own thread (engine_thread.py says why)
        engine_thread = EngineThread(lambda: LLMEngine(config), step_timeout_s=config.step_timeout_s)
        engine = engine_thread.engine
        metrics = None
        if enable_metrics:
            labels = {"model": args["model_name"], "version": args["model_version"]}
            try:
                speculative = engine.config.speculative
                metrics = EngineMetrics(pb_utils, labels, report_vllm_metrics, engine.max_model_len, engine.config.max_num_seqs,
                                        speculative.num_speculative_tokens if speculative else 0)
            except Exception as error:  # tritonserver --allow-metrics=false
                if "metrics not supported" not in str(error):
                    raise
                log_info(pb_utils, "metrics are off in this server (--allow-metrics=false); serving without them")
        return cls(pb_utils, engine_thread, engine.tokenizer, engine.stats, metrics, engine.model_config.generation_defaults)

    # -- requests in -------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        """Submit each request (or apply a cancel control request); responses follow on the response thread."""
        for request in requests:
            self._accept(request)
        return None

    def _accept(self, request: Any) -> None:
        response_sender = request.get_response_sender()
        bls_caller, submitted = False, None
        try:
            inputs = request_inputs(request)
            bls_caller = _is_bls_caller(inputs)
            if "cancel_request_id" in inputs:
                self._cancel(scalar(inputs, "cancel_request_id"))
                response_sender.send(flags=self.final_flag)
                return
            requested, reply, rendered_reply, images = request.requested_output_names(), None, None, None
            if self.contract is not None and "input_ids" not in inputs:
                if isinstance(self.contract, VllmText) and "image" in inputs:  # the engine's processor expands
                    prompt_ids, images = self.engine_thread.prompt_inputs(  # the placeholders: its ids, its images
                        image_prompt(inputs, image_input(inputs) or []))
                    plan = self.contract.plan_tokens(inputs, set(requested), self.tokenizer, prompt_ids)
                else:
                    plan = self.contract.plan(inputs, set(requested), self.tokenizer)
                inputs, requested, reply = plan.engine_inputs, plan.engine_outputs, plan.reply
                rendered_reply = plan.rendered_reply
            parsed = parse_engine_request(inputs, self.tokenizer, request.parameters(), requested, self.model_defaults)
            parsed.bls_caller = bls_caller
            request_id = request.request_id()
            if request_id and bls_caller and self.cancelled_early.take(request_id):
                self._finish(response_sender, CANCELLED, bls_caller)
                return
            if not request_id or request_id in self.active:  # an id nobody can guess (cancel_request_id names ids)
                request_id = f"{request_id or 'req'}#{secrets.token_hex(8)}"
            if bls_caller:  # frees the BLS thread the caller holds until a first response
                response_sender.send(self.pb_utils.InferenceResponse(output_tensors=[]))
            with self.lock:
                self.active[request_id] = ActiveRequest(response_sender, parsed, RequestTiming(time.monotonic()),
                                                        reply=reply, rendered_reply=rendered_reply)
            submitted = request_id
            self.engine_thread.submit(request_id, parsed.prompt_token_ids, parsed.params, self.outbox.put, images)
        except Exception as error:  # noqa: BLE001 - any failure to start a request is that request's error final
            if submitted is not None:
                with self.lock:
                    self.active.pop(submitted, None)
            self._finish(response_sender, Failure.of(error), bls_caller)

    def _cancel(self, target: str) -> None:
        """A control request (how a relay forwards its client's cancellation): abort the relay's
        request named by `cancel_request_id`, or refuse it when it arrives later. Only requests
        of relays (`bls_caller`), whose ids they make unguessable (uuid4), can be named: a
        client's own request ends only by its own cancellation, whatever id another client sends."""
        with self.lock:
            active = self.active.get(target)
        if active is None:
            self.cancelled_early.add(target)
        elif active.request.bls_caller:
            self._abort(target, active, None)

    def _abort(self, request_id: str, active: ActiveRequest, failure: Failure | None) -> None:
        with self.lock:
            if active.abort_sent:
                return
            active.abort_sent, active.failure = True, failure
        self.engine_thread.abort(request_id)

    # -- responses out -------------------------------------------------------------
    def _response_loop(self) -> None:
        name_native_thread(self.response_thread.name)
        while (output := self.outbox.get()) is not None:
            try:
                self._handle(output)
            except Exception:  # this thread must outlive anything: every later response depends on it
                logger.exception("handling an output of %s failed", output.request_id)

    def _handle(self, output: RequestOutput) -> None:
        with self.lock:  # the watcher must not ask a finished sender whether it was cancelled
            active = self.active.pop(output.request_id, None) if output.finished else self.active.get(output.request_id)
        if active is None:
            return
        active.generating = True
        try:
            self._respond(active, output)
        except Exception as error:  # never lose the final: end the request with the failure
            logger.exception("responding to %s failed", output.request_id)
            failure = Failure(f"sending a response failed: {type(error).__name__}: {error}")
            if output.finished:
                self._finish(active.response_sender, failure, active.request.bls_caller)
            else:
                self._abort(output.request_id, active, failure)

    def _respond(self, active: ActiveRequest, output: RequestOutput) -> None:
        """Streaming: one response per output, final flag on the last. Otherwise one merged response."""
        self._count(active, output)
        bls_caller = active.request.bls_caller
        if output.error is not None:
            self._finish(active.response_sender, Failure(f"engine failure: {output.error}"), bls_caller)
            return
        if output.finish_reason == "abort":
            if active.failure is None:  # the server log says so, as vLLM's backend's does
                log_info(self.pb_utils, f"[pagedserve] aborted request {output.request_id} in the engine "
                         "after its client cancelled it; its KV blocks are free")
                if active.reply is not None:  # a text client's final carries nothing, as in vLLM's backend
                    send_final(active.response_sender, None, self.final_flag)
                    return
            self._finish(active.response_sender, active.failure or CANCELLED, bls_caller)
            return
        if not active.request.stream:
            active.pending = output if active.pending is None else merge_outputs(active.pending, output)
            if not output.finished:
                return
            output = active.pending
        replies = self._replies(active, output)
        responses = [self.pb_utils.InferenceResponse(output_tensors=to_tensors(self.pb_utils, t)) for t in replies]
        last = responses.pop() if responses else None
        for response in responses:
            active.response_sender.send(response)
        if output.finished:
            send_final(active.response_sender, last, self.final_flag)
        elif last is not None:
            active.response_sender.send(last)

    def _replies(self, active: ActiveRequest, output: RequestOutput) -> list[dict[str, Any]]:
        """The client's responses' tensors for an output. A text client whose text leaves out
        the prompt (every streaming one) gets the text the engine rendered: building a streamed
        token's response by decoding its ids again held the GIL far longer than this does
        (benchmarks/RESULTS.md, "Figures behind design choices in the code")."""
        request = active.request
        if active.rendered_reply is not None and request.exclude_input:
            tensors = engine_response(request, output, self.tokenizer, only=CLIENT_OUTPUTS)
            return active.rendered_reply(tensors, [sample.text for sample in output.per_sample()])
        tensors = engine_response(request, output, self.tokenizer)
        return [tensors] if active.reply is None else active.reply(tensors)

    def _count(self, active: ActiveRequest, output: RequestOutput) -> None:
        """Metrics of an output; a failure here is logged, never the request's end."""
        if self.metrics is None:
            return
        try:
            self.metrics.on_output(output, active.timing, active.request.params.n, time.monotonic())
        except Exception:
            logger.exception("counting the metrics of %s failed", output.request_id)

    def _finish(self, response_sender: Any, failure: Failure, bls_caller: bool) -> None:
        """End a request with `failure`: a Triton error, or for a BLS caller the `error` output."""
        if bls_caller:
            response = self.pb_utils.InferenceResponse(output_tensors=to_tensors(self.pb_utils, failure.tensors()))
        else:
            response = failure.response(self.pb_utils)
        send_final(response_sender, response, self.final_flag)

    # -- cancellation and gauges ---------------------------------------------------
    def _watch(self) -> None:
        """Abort what clients cancelled (BLS callers send cancel requests instead), refresh the gauges."""
        with self.lock:
            watched = {request_id: active.generating for request_id, active in self.active.items()
                       if not active.abort_sent and not active.request.bls_caller}
        generating = {request_id for request_id, started in watched.items() if started}
        for request_id in self.asks.ask(watched, self._asked_cancelled, generating):
            with self.lock:
                active = self.active.get(request_id)
            if active is not None:
                self._abort(request_id, active, None)
        if self.metrics is not None and time.monotonic() >= self.next_gauges:
            self.next_gauges = time.monotonic() + GAUGE_INTERVAL_S
            self.metrics.refresh(self.stats(), self.is_ready())

    def is_ready(self) -> bool:
        """The engine serves (Triton asks the model where its python backend supports `is_ready`):
        False once recovery failed, while a step hangs, and from unloading on."""
        return bool(self.engine_thread.is_ready)

    def _asked_cancelled(self, request_id: str) -> bool:
        with self.lock:  # one ask at a time: the response thread waits for one round trip at most
            active = self.active.get(request_id)
            return active is not None and asked_cancelled(active.response_sender)

    def finalize(self) -> None:
        """Cancel what is in flight (clients get CANCELLED), then join every thread."""
        log_info(self.pb_utils, f"[pagedserve] unloading: cancelling {len(self.active)} requests in flight")
        self.engine_thread.shutdown(timeout=30)
        self.outbox.put(None)
        self.response_thread.join(30)
        self.watcher.stop()


def beside_the_model(args: Mapping[str, str]) -> str:
    """The adapters' list of a model with enable_lora and no lora_modules: multi_lora.json in its version
    folder, where Triton's vLLM backend reads it."""
    path = os.path.join(args["model_repository"], str(args["model_version"]), MULTI_LORA_FILE)
    if not os.path.exists(path):
        raise ConfigError("lora_modules", f"enable_lora is true and {path} does not exist; list the adapters there "
                                          "({\"name\": \"adapter folder\"}) or set lora_modules")
    return path


def _is_bls_caller(inputs: Mapping[str, Any]) -> bool:
    try:
        return flag(inputs, BLS_CALLER)
    except InvalidRequestError:  # not from a relay: its mistake is reported as usual
        return False


class TextEngineModel(EngineModel):
    """`llm`: the engine, speaking Triton's vLLM backend's text contract (token ids too)."""

    contract: Contract | None = VllmText()
