"""The `llm` relay: tokenize, stream through llm_engine over (fake) BLS, text deltas out."""

from __future__ import annotations

import threading

import pytest

from pagedserve.backend.outputs import RequestOutput
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.triton_adapter.requests import EngineRequest
from pagedserve.backend.triton_adapter.responses import ENGINE_OUTPUTS, engine_response
from pagedserve.backend.triton_adapter.tensors import to_tensors
from pagedserve.backend.triton_adapter.text_model import TextModel

from .fakes import FINAL, CharTokenizer, FakePbUtils, InferenceResponse, Request, TritonError, wait_until

TOKENIZER = CharTokenizer()


class EngineOverBLS:
    """llm_engine as `llm` sees it: scripted text deltas, then (when `hold`) nothing
    until a cancel control request arrives; every stream ends with a flag-only final."""

    def __init__(self, deltas: list[str], hold: bool = False, error: str | None = None):
        self.deltas, self.hold, self.error = deltas, hold, error
        self.cancel_ids: list[str] = []
        self.cancelled = threading.Event()
        self.drained = threading.Event()
        self.pb_utils = FakePbUtils(self)

    def __call__(self, request):
        if "cancel_request_id" in request.inputs:
            self.cancel_ids.append(request.inputs["cancel_request_id"][0].decode())
            self.cancelled.set()
            return iter([InferenceResponse()])
        return self._stream(request)

    def _stream(self, request):
        engine_request = EngineRequest(request.inputs["input_ids"].tolist(), SamplingParams(), stream=True)
        for index, text in enumerate(self.deltas):
            finished = index == len(self.deltas) - 1 and not (self.hold or self.error)
            output = RequestOutput(request.request_id, TOKENIZER.encode(text), [], text, finished)
            yield InferenceResponse(to_tensors(self.pb_utils, engine_response(engine_request, output, TOKENIZER)))
        if self.hold:
            assert self.cancelled.wait(5)
            yield InferenceResponse(error=TritonError("request cancelled", TritonError.CANCELLED))
        if self.error:
            yield InferenceResponse(error=TritonError(self.error))
        yield InferenceResponse()  # the flag-only final
        self.drained.set()


def texts(sender) -> list[str]:
    return [b"".join(r.outputs()["text_output"]).decode() for r in sender.responses if not r.has_error()]


@pytest.fixture
def make_model():
    models = []

    def make(engine: EngineOverBLS) -> TextModel:
        models.append(TextModel(engine.pb_utils, TOKENIZER))
        return models[-1]

    yield make
    for model in models:
        model.finalize()


def test_streams_text_deltas_with_the_final_flag_on_the_last(make_model):
    engine = EngineOverBLS(["Hel", "lo!"])
    model = make_model(engine)
    request = Request({"text_input": "Hi", "stream": True, "max_tokens": 4}, parameters='{"seed": 1}')
    model.execute([request])
    sent = request.sender.wait_final()
    assert texts(request.sender) == ["Hel", "lo!"] and [f for _, f in sent] == [0, FINAL]
    (forwarded,) = engine.pb_utils.bls_requests
    assert forwarded.model_name == "llm_engine" and forwarded.requested_output_names == list(ENGINE_OUTPUTS)
    assert forwarded.inputs["input_ids"].tolist() == [ord("H"), ord("i")] and "text_input" not in forwarded.inputs
    assert forwarded.inputs["max_tokens"].tolist() == [4] and forwarded.parameters == {"seed": 1}
    assert engine.drained.wait(5)
    wait_until(lambda: not model.active)


def test_invalid_prompt_is_invalid_arg_and_the_model_keeps_serving(make_model):
    engine = EngineOverBLS(["ok"])
    model = make_model(engine)
    bad, good = Request({"text_input": ""}), Request({"text_input": "x"})
    model.execute([bad, good])
    (response, flags), = bad.sender.wait_final()
    assert flags == FINAL and response.error().code() == TritonError.INVALID_ARG
    assert "'text_input'" in response.error().message()
    good.sender.wait_final()
    assert texts(good.sender) == ["ok"]
    assert len(engine.pb_utils.bls_requests) == 1


def test_engine_error_reaches_the_client_as_its_final_response(make_model):
    engine = EngineOverBLS(["a"], error="engine failure: boom")
    model = make_model(engine)
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    sent = request.sender.wait_final()
    assert texts(request.sender) == ["a"] and sent[-1][1] == FINAL
    assert sent[-1][0].error().message() == "engine failure: boom"
    assert engine.drained.wait(5)


def test_a_client_gone_mid_stream_cancels_in_the_engine_and_the_stream_is_drained(make_model):
    engine = EngineOverBLS(["a", "b", "c"])
    model = make_model(engine)
    request = Request({"text_input": "x", "stream": True})
    request.sender.fail_after = 1
    model.execute([request])
    assert engine.drained.wait(5)
    assert engine.cancel_ids == [engine.pb_utils.bls_requests[0].request_id]
    assert texts(request.sender) == ["a"]
    wait_until(lambda: not model.active)


def test_client_cancellation_aborts_in_the_engine(make_model):
    engine = EngineOverBLS(["a"], hold=True)
    model = make_model(engine)
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    wait_until(lambda: len(request.sender.sent) == 1)
    request.sender.cancelled = True
    assert engine.cancelled.wait(5)
    assert engine.cancel_ids == [engine.pb_utils.bls_requests[0].request_id]
    assert request.sender.wait_final()[-1][0].error().message() == "request cancelled"
    assert engine.drained.wait(5)
    assert not request.sender.asked_after_final


def test_finalize_cancels_in_flight_requests(make_model):
    engine = EngineOverBLS(["a"], hold=True)
    model = TextModel(engine.pb_utils, TOKENIZER)
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    wait_until(lambda: len(request.sender.sent) == 1)
    model.finalize()
    assert engine.cancel_ids == [engine.pb_utils.bls_requests[0].request_id]
    assert engine.drained.is_set() and not model.watcher_thread.is_alive()
