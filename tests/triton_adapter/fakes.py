"""A small stand-in for Triton's `triton_python_backend_utils`, plus a fake engine
thread and a character tokenizer, so the adapter's models run without a server
or a model load."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from pagedserve.backend.outputs import RequestOutput
from pagedserve.backend.triton_adapter.responses import ENGINE_OUTPUTS

FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None):
        self._tensors, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def outputs(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self._tensors}


class Metric:
    def __init__(self, family: "MetricFamily", labels: dict, buckets: list[float] | None = None):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.total = 0.0
        self.observations: list[float] = []

    def increment(self, value: float) -> None:
        self.total += value

    def set(self, value: float) -> None:
        self.total = value

    def observe(self, value: float) -> None:
        self.observations.append(value)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = range(3)

    def __init__(self, name: str, description: str, kind: int):
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict, buckets: list[float] | None = None) -> Metric:  # noqa: N802 (Triton's name)
        return Metric(self, labels, buckets)


class ResponseSender:
    """Records what is sent; like Triton's, it is gone once a final response went out.

    A send that fails (`fail_after`, `fail_final`) raises; a failed final still
    closes the request, as the stub marks the sender closed before sending.
    """

    def __init__(self, fail_after: int | None = None):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.finals = 0  # final flags that reached the server, sent or not
        self.cancelled = False
        self.fail_after = fail_after  # sends that succeed before the client is gone
        self.fail_final = False
        self.asked_after_final = False
        self.done = threading.Event()
        self.updates: queue.Queue = queue.Queue()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            raise RuntimeError("Unable to send response. Response sender has been closed.")
        failing = response is not None and (
            (self.fail_final and flags & FINAL) or (self.fail_after is not None and len(self.sent) >= self.fail_after))
        if not failing:
            self.sent.append((response, flags))
            self.updates.put((response, flags))
        if flags & FINAL:
            self.finals += 1
            self.done.set()
        if failing:
            raise RuntimeError("the client is gone")

    def stream(self, timeout: float = 5.0) -> Iterator[InferenceResponse]:
        """What a BLS caller's response iterator yields for this request: every response,
        an empty one for a flag-only final. Like Triton 2.51 it loses an error response
        that is not the first (the stream then never ends: an AssertionError here)."""
        first = True
        while True:
            try:
                response, flags = self.updates.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError("the BLS stream never ended") from None
            if response is not None and response.has_error() and not first:
                continue
            first = False
            yield response if response is not None else InferenceResponse()
            if flags & FINAL:
                return

    def is_cancelled(self) -> bool:
        if self.done.is_set():
            self.asked_after_final = True  # a use-after-free in the real server
        return self.cancelled

    def wait_final(self, timeout: float = 5.0) -> list[tuple[InferenceResponse | None, int]]:
        assert self.done.wait(timeout), f"no final response; sent so far: {self.sent}"
        return self.sent

    @property
    def responses(self) -> list[InferenceResponse]:
        return [r for r, _ in self.sent if r is not None]

    @property
    def flags(self) -> list[int]:
        return [f for _, f in self.sent]


TRTLLM_OUTPUTS = ("INPUT_ID", "REQUEST_INPUT_LEN", "BAD_WORDS_IDS", "STOP_WORDS_IDS", "REQUEST_OUTPUT_LEN", "OUT_END_ID",
                  "OUT_PAD_ID", "OUTPUT", "output_ids", "sequence_length", "cum_log_probs", "output_log_probs",
                  "batch_index", "sequence_index", "context_ids", "context_length", "trim_chars")
ALL_OUTPUTS = ("text_output", *ENGINE_OUTPUTS, *TRTLLM_OUTPUTS)
"""Every output of our models: what Triton lists as requested when a client names none."""


class Request:
    """A request as execute() receives it."""

    def __init__(self, inputs: dict[str, Any], request_id: str = "", parameters: str = "{}", outputs=ALL_OUTPUTS):
        self._inputs = {name: as_array(value) for name, value in inputs.items()}
        self._request_id, self._parameters = request_id, parameters
        self._outputs = list(outputs)
        self.sender = ResponseSender()

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def inputs(self) -> list[Tensor]:
        return [Tensor(n, a) for n, a in self._inputs.items()]

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        return self._parameters

    def get_response_sender(self) -> ResponseSender:
        return self.sender


def as_array(value: Any) -> np.ndarray:
    """Client-side encoding: str/bytes -> BYTES, bool -> BOOL, int -> INT32, float -> FP32."""
    if isinstance(value, np.ndarray):
        return value
    array = np.array(value if isinstance(value, list) else [value], dtype=np.object_)  # nested lists: [batch, ...]
    flat = array.reshape(-1)
    first = flat[0] if flat.size else None
    if isinstance(first, (str, bytes)):
        return np.array([v.encode() if isinstance(v, str) else v for v in flat], dtype=np.object_).reshape(array.shape)
    if isinstance(first, bool):
        return array.astype(np.bool_)
    if isinstance(first, float):
        return array.astype(np.float32)
    return array.astype(np.int32)


class Logger:
    """pb_utils.Logger: lines the server would log."""

    lines: list[str] = []

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.lines.append(message)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.lines.append(f"W {message}")

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.lines.append(f"E {message}")


class FakePbUtils:
    """The module's surface the adapter uses; BLS calls go to `bls_handler`."""

    Tensor = Tensor
    TritonError = TritonError
    InferenceResponse = InferenceResponse
    MetricFamily = MetricFamily
    Logger = Logger
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    def __init__(self, bls_handler: Callable[[Any], Iterator[InferenceResponse]] | None = None):
        self.bls_handler = bls_handler
        self.bls_requests: list[Any] = []
        fake = self

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names, request_id="", parameters=None):
                self.model_name, self.requested_output_names = model_name, requested_output_names
                self.inputs = {t.name(): t.as_numpy() for t in inputs}
                self.request_id, self.parameters = request_id, parameters

            def exec(self, decoupled: bool = False) -> Iterator[InferenceResponse]:
                assert decoupled
                fake.bls_requests.append(self)
                return fake.bls_handler(self)

        self.InferenceRequest = InferenceRequest


class FakeEngineThread:
    """EngineThread's surface: outputs are pushed by the test with emit()."""

    def __init__(self, submit_error: Exception | None = None):
        self.submit_error = submit_error
        self.submitted: dict[str, tuple[list[int], Any]] = {}
        self.callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self.aborted: list[str] = []
        self.shut_down = False
        self.is_ready = True
        self.images: dict[str, Any] = {}
        """Each submitted request's processed images (None: text)."""

    def submit(self, request_id, prompt_token_ids, params, on_output, mm=None) -> None:
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted[request_id] = (list(prompt_token_ids), params)
        self.images[request_id] = mm
        self.callbacks[request_id] = on_output

    def emit(self, request_id: str, new_ids: list[int], finished: bool = False, **fields: Any) -> None:
        callback = self.callbacks.pop(request_id) if finished else self.callbacks[request_id]
        prompt = self.submitted[request_id][0]
        fields.setdefault("finish_reason", "length" if finished else None)
        fields.setdefault("text", "".join(map(chr, new_ids)))  # rendered as the engine would, by CharTokenizer
        callback(RequestOutput(request_id=request_id, new_token_ids=new_ids, context_token_ids=[],
                               finished=finished, num_prompt_tokens=len(prompt), **fields))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.callbacks:
            self.emit(request_id, [], finished=True, finish_reason="abort")

    def shutdown(self, timeout: float = 30.0) -> None:
        self.shut_down = True
        for request_id in list(self.callbacks):
            self.abort(request_id)


class CharTokenizer:
    """One token per character (its code point): deltas are easy to read in asserts."""

    chat_template = None
    eos_token_id = 3
    pad_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def submit(model: Any, engine_thread: Any, request_id: str = "r1", **inputs: Any) -> Request:
    """An `llm_engine` request with prompt [5, 6, 7] and `inputs`, executed by `model`."""
    request = Request({"input_ids": [5, 6, 7], **inputs}, request_id=request_id)
    model.execute([request])
    return request


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
