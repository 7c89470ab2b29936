"""Triton model `llm`: text in, text out, decoupled.

Tokenizes in-process, streams the request through `llm_engine` over BLS, and
turns each engine response into a text delta. It is a python model rather than
an ensemble because Triton (2.51) does not pass a client's cancellation into an
ensemble's steps: here the watcher sees it and tells llm_engine to abort.
"""

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.backend.loader import load_tokenizer, resolve_model_path
from pagedserve.backend.triton_glue import model_parameters, request_inputs, to_tensors
from pagedserve.backend.triton_protocol import ENGINE_OUTPUTS, TEXT_LEVEL_INPUTS, parse_prompt, text_response

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE = "llm_engine"
WATCH_INTERVAL_S = 0.02


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(resolve_model_path(model_parameters(args).get("model", "")))
        self.relays = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="llm-relay")
        self.active: dict[str, object] = {}  # request id -> response sender, until its final response
        self.lock = threading.Lock()  # a sender's factory is gone once its final response is sent
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_loop, name="llm-watcher", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = request_inputs(request)
                prompt_ids = parse_prompt(inputs, self.tokenizer)
            except Exception as error:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
                continue
            forwarded = [t for t in request.inputs() if t.name() not in TEXT_LEVEL_INPUTS]
            forwarded.append(pb_utils.Tensor("input_ids", np.asarray(prompt_ids, dtype=np.int32)))
            request_id = uuid.uuid4().hex
            with self.lock:
                self.active[request_id] = sender
            self.relays.submit(self._relay, request_id, sender, forwarded, request.parameters())
        return None

    def _relay(self, request_id, sender, inputs, parameters):
        """Stream llm_engine's responses back as text; the final flag rides on the last one."""
        try:
            engine_request = pb_utils.InferenceRequest(
                model_name=ENGINE, inputs=inputs, requested_output_names=list(ENGINE_OUTPUTS),
                request_id=request_id, parameters=json.loads(parameters or "{}"),
            )
            for response in engine_request.exec(decoupled=True):
                if response.has_error():
                    self._send_final(request_id, sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(response.error().message())))
                    return
                if not response.output_tensors():
                    continue  # a flag-only final: ours went with the last data
                outputs = {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in ENGINE_OUTPUTS}
                reply = pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, text_response(outputs, self.tokenizer)))
                if bool(outputs["finished"][0]):
                    self._send_final(request_id, sender, reply)
                else:
                    sender.send(reply)
        except Exception as error:
            self._send_final(request_id, sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(error).__name__}: {error}")))

    def _send_final(self, request_id, sender, response):
        with self.lock:  # the watcher must not ask a finished sender whether it was cancelled
            self.active.pop(request_id, None)
        sender.send(response, flags=FINAL)

    def _watch_loop(self):
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                cancelled = [rid for rid, sender in self.active.items() if sender.is_cancelled()]
                for request_id in cancelled:
                    del self.active[request_id]
            for request_id in cancelled:
                self._cancel_in_engine(request_id)

    def _cancel_in_engine(self, request_id):
        cancel = pb_utils.InferenceRequest(
            model_name=ENGINE,
            inputs=[pb_utils.Tensor("cancel_request_id", np.array([request_id.encode()], dtype=np.object_))],
            requested_output_names=[],
        )
        for _ in cancel.exec(decoupled=True):
            pass

    def finalize(self):
        """Abort in-flight requests in the engine so every relay ends, then join the threads."""
        self.stopping.set()
        self.watcher.join(5)
        with self.lock:
            in_flight = list(self.active)
        for request_id in in_flight:
            try:
                self._cancel_in_engine(request_id)
            except Exception:  # llm_engine already unloaded: its finalize ended the streams
                pass
        self.relays.shutdown(wait=True, cancel_futures=True)
