"""The `llm` model: text in, text out, decoupled.

Tokenizes in-process, streams the request through `llm_engine` over BLS, and
turns each engine response into a text delta. It is a python model rather than
an ensemble because Triton (2.51) does not pass a client's cancellation into an
ensemble's steps: here the watcher sees it and tells llm_engine to abort.

Triton traps kept here: `is_cancelled()` is asked only of senders still in
`active` (a request leaves it before its final response); request and response
tensors are copied out of shared memory; every BLS stream is read to its end.
"""

from __future__ import annotations

import faulthandler
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from .arguments import tokenizer_from_args
from .requests import parse_prompt
from .responses import ENGINE_OUTPUTS, TEXT_LEVEL_INPUTS, error_response, text_response
from .tensors import Arrays, request_inputs, tensor_arrays, to_tensors

ENGINE_MODEL = "llm_engine"
WATCH_INTERVAL_S = 0.02
MAX_RELAYS = 1024


class TextModel:
    """`llm`: one relay thread per request, plus a watcher for client cancellation."""

    def __init__(self, pb_utils: Any, tokenizer: Any, engine_model: str = ENGINE_MODEL):
        self.pb_utils = pb_utils
        self.final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.tokenizer = tokenizer
        self.engine_model = engine_model
        self.relays = ThreadPoolExecutor(max_workers=MAX_RELAYS, thread_name_prefix="llm-relay")
        self.active: dict[str, Any] = {}  # request id -> response sender, until its final response
        self.lock = threading.Lock()  # a sender's factory is gone once its final response is sent
        self.stopping = threading.Event()
        self.watcher_thread = threading.Thread(target=self._watch_loop, name="llm-watcher", daemon=True)
        self.watcher_thread.start()

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> TextModel:
        faulthandler.enable()  # a fatal error in the stub prints every thread's Python stack to the server log
        return cls(pb_utils, tokenizer_from_args(args))

    def execute(self, requests: list[Any]) -> None:
        """Tokenize each request and start its relay; an unreadable prompt is answered INVALID_ARG at once."""
        for request in requests:
            response_sender = request.get_response_sender()
            try:
                inputs = request_inputs(request)
                prompt_ids = parse_prompt(inputs, self.tokenizer)
            except Exception as error:
                response = error_response(self.pb_utils, str(error), self.pb_utils.TritonError.INVALID_ARG)
                response_sender.send(response, flags=self.final_flag)
                continue
            # New tensors over our own copies: the relay runs after execute() returns.
            forwarded = {name: array for name, array in inputs.items() if name not in TEXT_LEVEL_INPUTS}
            forwarded["input_ids"] = np.asarray(prompt_ids, dtype=np.int32)
            request_id = uuid.uuid4().hex
            with self.lock:
                self.active[request_id] = response_sender
            self.relays.submit(self._relay, request_id, response_sender, forwarded, request.parameters())
        return None

    def _relay(self, request_id: str, response_sender: Any, inputs: Arrays, parameters: str | None) -> None:
        """Stream llm_engine's responses back as text; the final flag rides on the last one.

        The engine's stream is always read to its end, even once our final response is
        out or the client is gone: dropping a BLS stream before its final response may
        free what the engine's last response still refers to in the server.
        """
        pb_utils = self.pb_utils
        done = False  # our final response went out, or the client cannot take more
        try:
            engine_request = pb_utils.InferenceRequest(
                model_name=self.engine_model, inputs=to_tensors(pb_utils, inputs),
                requested_output_names=list(ENGINE_OUTPUTS), request_id=request_id,
                parameters=json.loads(parameters or "{}"),
            )
            for response in engine_request.exec(decoupled=True):
                if done:
                    continue
                if response.has_error():
                    reply, final = error_response(pb_utils, response.error().message()), True
                elif not response.output_tensors():
                    continue  # a flag-only final: ours went with the last data
                else:
                    outputs = tensor_arrays(response.output_tensors())
                    reply = pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, text_response(outputs, self.tokenizer)))
                    final = bool(outputs["finished"][0])
                done = final
                if not self._deliver(request_id, response_sender, reply, final) and not final:
                    done = True  # the client is gone: stop generating, keep draining
                    self._cancel_in_engine(request_id)
        except Exception as error:
            if not done:
                self._deliver(request_id, response_sender, error_response(pb_utils, f"{type(error).__name__}: {error}"), True)

    def _deliver(self, request_id: str, response_sender: Any, response: Any, final: bool) -> bool:
        """Send to the client; False when that failed (a broken or cancelled request)."""
        if final:
            with self.lock:  # the watcher must not ask a finished sender whether it was cancelled
                self.active.pop(request_id, None)
        try:
            response_sender.send(response, flags=self.final_flag if final else 0)
            return True
        except Exception:
            with self.lock:
                self.active.pop(request_id, None)
            return False

    def _watch_loop(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                cancelled = [rid for rid, sender in self.active.items() if sender.is_cancelled()]
                for request_id in cancelled:
                    del self.active[request_id]
            for request_id in cancelled:
                self._cancel_in_engine(request_id)

    def _cancel_in_engine(self, request_id: str) -> None:
        """Ask llm_engine to abort `request_id` (a control request; its stream is drained too)."""
        cancel = self.pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=[self.pb_utils.Tensor("cancel_request_id", np.array([request_id.encode()], dtype=np.object_))],
            requested_output_names=[],
        )
        for _ in cancel.exec(decoupled=True):
            pass

    def finalize(self) -> None:
        """Abort in-flight requests in the engine so every relay ends, then join the threads."""
        self.stopping.set()
        self.watcher_thread.join(5)
        with self.lock:
            in_flight = list(self.active)
        for request_id in in_flight:
            try:
                self._cancel_in_engine(request_id)
            except Exception:  # llm_engine already unloaded: its finalize ended the streams
                pass
        self.relays.shutdown(wait=True, cancel_futures=True)
