"""The relay models over the engine's model (`llm`, which hosts the engine):
`llm_engine` (token ids in and out), `tensorrt_llm_bls` / `tensorrt_llm`
(TensorRT-LLM's contract; contracts.py).

Each translates its client's request in-process (tokenizing where the contract is
text), streams it through `llm` over BLS as token ids, and turns each engine
response into its client's responses. They are python models rather than
ensembles because Triton (2.51) does not pass a client's cancellation into an
ensemble's steps: here the watcher sees it and tells the engine to abort.
A relay costs a process hop per streamed token; `llm` itself has none.

Triton (2.51) traps kept here:
- `is_cancelled()` is asked only of senders still in `active` (a request leaves
  it before its final response).
- request and response tensors are copied out of shared memory.
- every BLS stream is read to its end, after an exception too, and its iterator
  is kept a while longer (`_drain` says why).
- every client request gets exactly one final, also when a send fails.
- only the outputs the client asked for are built, or requested from the engine.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import InvalidRequestError
from .arguments import ENGINE_MODEL, model_parameters, tokenizer_from_args
from .cancellation import WATCH_INTERVAL_S, AskRotation, Watcher, asked_cancelled
from .contracts import Contract, EngineTokens, RelayPlan, TrtllmText, TrtllmTokens, VllmText
from .finals import ERROR_OUTPUT, Failure, send_final
from .python_model import log_info
from .requests import BLS_CALLER
from .tensors import request_inputs, tensor_arrays, to_tensors

logger = logging.getLogger("pagedserve")
MAX_RELAYS = 1024
ITERATOR_GRACE_S = 2.0


@dataclass
class Relay:
    """One client request, from execute() until its relay has drained the engine's stream."""

    request_id: str
    response_sender: Any
    plan: RelayPlan
    parameters: str | None
    client_id: str = ""
    """The client's own request id (TensorRT-LLM's `stop` names it)."""
    open: bool = True
    """No final response sent to the client yet."""
    cancelled: bool = False
    """Its client cancelled: nothing more goes out but a flag-only final."""


class RelayModel:
    """A relay: one thread per request, plus a watcher for client cancellation. The base speaks
    the vLLM backend's text contract (as `llm` does in-process); subclasses name others."""

    contract: Contract = VllmText()
    """Which client contract this model speaks (subclasses name others)."""

    def __init__(self, pb_utils: Any, tokenizer: Any, engine_model: str = ENGINE_MODEL):
        self.pb_utils = pb_utils
        self.final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.tokenizer = tokenizer
        self.engine_model = engine_model
        self.relays = ThreadPoolExecutor(max_workers=MAX_RELAYS, thread_name_prefix="llm-relay")
        self.active: dict[str, Relay] = {}  # until its final response
        self.lock = threading.Lock()  # a sender's factory is gone once its final response is sent
        self.drained: deque[tuple[float, Any]] = deque()  # (when to let go, drained BLS iterator)
        self.asks = AskRotation()
        self.watcher = Watcher("llm-watcher", self._watch, WATCH_INTERVAL_S)

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> RelayModel:
        faulthandler.enable()  # a fatal error in the stub prints every thread's Python stack to the server log
        model = cls(pb_utils, tokenizer_from_args(args))
        model.contract = model.contract.configured(model_parameters(args))
        return model

    def execute(self, requests: list[Any]) -> None:
        """Tokenize each request and start its relay; an unreadable prompt is answered INVALID_ARG at once."""
        for request in requests:
            response_sender = request.get_response_sender()
            try:
                relay = self._prepare(request, response_sender)
            except Exception as error:  # noqa: BLE001 - an unreadable request is answered INVALID_ARG at once
                send_final(response_sender, Failure(str(error), "INVALID_ARG").response(self.pb_utils), self.final_flag)
                continue
            if relay is None:
                continue
            with self.lock:
                self.active[relay.request_id] = relay
            self.relays.submit(self._relay, relay)
        return None

    def _prepare(self, request: Any, response_sender: Any) -> Relay | None:
        """The relay of a request (None: a control request, answered here): its inputs
        for the engine, our own copies since the relay runs after execute() returns."""
        inputs = request_inputs(request)
        plan = self.contract.plan(inputs, set(request.requested_output_names()), self.tokenizer)
        client_id = request.request_id() or ""
        if plan.stops:
            self._stop(client_id)
            send_final(response_sender, None, self.final_flag)
            return None
        plan.engine_inputs[BLS_CALLER] = np.array([True], dtype=np.bool_)
        return Relay(
            request_id=uuid.uuid4().hex,
            response_sender=response_sender,
            plan=plan,
            parameters=request.parameters(),
            client_id=client_id,
        )

    def _stop(self, client_id: str) -> None:
        """TensorRT-LLM's `stop` request: end the request in flight with the same request id."""
        with self.lock:
            targets = [r.request_id for r in self.active.values() if client_id and r.client_id == client_id]
        if not targets:
            raise InvalidRequestError(
                "stop", f"no request with id {client_id!r} is in flight; send the id of the request to stop"
            )
        for request_id in targets:
            self._cancel_in_engine(request_id)

    def _relay(self, relay: Relay) -> None:
        """Stream the engine's responses back in the client's contract; the final flag rides on the last one."""
        pb_utils = self.pb_utils
        responses, engine_done = None, False
        try:
            engine_request = pb_utils.InferenceRequest(
                model_name=self.engine_model, inputs=to_tensors(pb_utils, relay.plan.engine_inputs),
                requested_output_names=relay.plan.engine_outputs, request_id=relay.request_id,
                parameters=json.loads(relay.parameters or "{}"),
            )
            responses = engine_request.exec(decoupled=True)
            for response in responses:
                reply = self._reply(relay, response)
                if reply is None:
                    continue
                messages, final = reply
                engine_done = engine_done or final
                for index, message in enumerate(messages):
                    if relay.open:
                        self._deliver(relay, message, final and index == len(messages) - 1)
                if final and not messages:
                    self._close(relay, None)
        except Exception as error:
            logger.exception("the relay of %s failed", relay.request_id)
            self._close(relay, Failure(f"{type(error).__name__}: {error}").response(pb_utils))
            if not engine_done:  # nobody reads what it generates any more
                self._cancel_in_engine(relay.request_id)
        finally:
            if responses is not None:
                self._drain(responses)
            self._close(relay, Failure(f"{self.engine_model} ended the stream without a final response").response(pb_utils))

    def _reply(self, relay: Relay, response: Any) -> tuple[list[Any], bool] | None:
        """The client's responses for an engine response, and whether it is the last;
        None for one without outputs (the engine's acknowledgement, a flag-only final)."""
        pb_utils = self.pb_utils
        if response.has_error():
            return [Failure(response.error().message()).response(pb_utils)], True
        tensors = response.output_tensors()
        if not tensors:
            return None
        outputs = tensor_arrays(tensors)
        if ERROR_OUTPUT in outputs:
            return [Failure.from_outputs(outputs).response(pb_utils)], True
        messages = [pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, t)) for t in relay.plan.reply(outputs)]
        return messages, bool(outputs["finished"][0])

    def _deliver(self, relay: Relay, response: Any, final: bool) -> None:
        """Send to the client; when a non-final send fails (the client is gone), end the
        request with a flag-only final and stop generating for it."""
        if final:
            self._close(relay, response)
            return
        if relay.cancelled:
            return
        try:
            relay.response_sender.send(response, flags=0)
        except Exception:
            logger.exception("sending to the client of %s failed; ending the request", relay.request_id)
            self._close(relay, None)
            self._cancel_in_engine(relay.request_id)

    def _close(self, relay: Relay, response: Any) -> None:
        """Send the client's final response (None: a flag-only final), once (the relay
        and the watcher may both try). A cancelled request's final carries nothing, as
        in Triton's vLLM backend: a response sent into a cancelled gRPC stream can stay
        in tritonserver (2.51) and keep `llm` loaded past its exit timeout."""
        with self.lock:  # the watcher must not ask a finished sender whether it was cancelled
            if not relay.open:
                return
            relay.open = False
            self.active.pop(relay.request_id, None)
            if relay.cancelled:
                response = None
        send_final(relay.response_sender, response, self.final_flag)

    def _drain(self, responses: Iterator[Any]) -> None:
        """Read a BLS stream to its end, then keep its iterator for ITERATOR_GRACE_S.

        On 2.51 the stub's cleanup thread also holds a drained iterator until it has
        told the server; whichever lets go last destroys the responses in it, and that
        thread does so without the GIL (fixed in r24.12, python_backend#390). Keeping
        ours a few seconds makes the watcher (with the GIL) the last one.
        """
        try:
            while True:
                next(responses)  # not a for loop: iter() of a finished iterator starts over
        except StopIteration:
            pass
        except Exception:
            logger.exception("draining a stream from %s failed", self.engine_model)
        self.drained.append((time.monotonic() + ITERATOR_GRACE_S, responses))

    def _watch(self) -> None:
        """Forward client cancellations to the engine; let go of iterators drained long enough ago."""
        with self.lock:
            watched = list(self.active)
        cancelled = self.asks.ask(watched, self._take_cancelled)
        for request_id in cancelled:
            log_info(
                self.pb_utils,
                f"[pagedserve] request {request_id} cancelled by its client; cancelling it in {self.engine_model}",
            )
            self._cancel_in_engine(request_id)
        now = time.monotonic()
        while self.drained and self.drained[0][0] <= now:
            self.drained.popleft()

    def _take_cancelled(self, request_id: str) -> bool:
        """Whether the client cancelled it; if so it leaves `active` (the relay still sends its
        final, a flag-only one, when the engine has ended it)."""
        with self.lock:  # one ask at a time, on a sender whose final has not gone out
            relay = self.active.get(request_id)
            if relay is None or not asked_cancelled(relay.response_sender):
                return False
            self.active.pop(request_id).cancelled = True
        return True

    def _cancel_in_engine(self, request_id: str) -> None:
        """Ask the engine's model to abort `request_id` (a control request, drained like any stream);
        a request not there yet is refused when it arrives. Failures are logged."""
        pb_utils = self.pb_utils
        try:
            cancel = pb_utils.InferenceRequest(
                model_name=self.engine_model,
                inputs=[pb_utils.Tensor("cancel_request_id", np.array([request_id.encode()], dtype=np.object_)),
                        pb_utils.Tensor(BLS_CALLER, np.array([True], dtype=np.bool_))],
                requested_output_names=[],
            )
            self._drain(cancel.exec(decoupled=True))
        except Exception:
            logger.exception("cancelling %s in %s failed", request_id, self.engine_model)

    def finalize(self) -> None:
        """Abort in-flight requests in the engine so every relay ends, then join the threads."""
        self.watcher.stop()
        with self.lock:
            in_flight = list(self.active)
        log_info(self.pb_utils, f"[pagedserve] unloading: cancelling {len(in_flight)} requests in flight")
        for request_id in in_flight:
            self._cancel_in_engine(request_id)
        self.relays.shutdown(wait=True)
        if self.drained:  # let go of them while the stub is whole: at its exit they crash it
            time.sleep(max(0.0, self.drained[-1][0] - time.monotonic()))
            self.drained.clear()


class TrtllmBlsModel(RelayModel):
    """`tensorrt_llm_bls`: TensorRT-LLM's text-level contract over the same relay."""

    contract: Contract = TrtllmText()


class TrtllmEngineModel(RelayModel):
    """`tensorrt_llm`: TensorRT-LLM's token-level contract over the same relay (the
    ensemble's middle step; the engine stays in `llm`, loaded once)."""

    contract: Contract = TrtllmTokens()


class TokenRelayModel(RelayModel):
    """`llm_engine`: the engine's token ids in and out, relayed to `llm` unchanged."""

    contract: Contract = EngineTokens()
