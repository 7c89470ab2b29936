"""The `llm` relay: tokenize, stream through llm_engine over (fake) BLS, text deltas out.

llm_engine here is the real EngineModel over a fake engine thread, reached through a
fake BLS that behaves like Triton 2.51's (it loses an error response after a stream's
first), so the two models' protocol is what is tested."""

from __future__ import annotations

import json
import threading

import pytest

from pagedserve.backend.triton_adapter import contracts, relay_model
from pagedserve.backend.triton_adapter.engine_model import EngineModel
from pagedserve.backend.triton_adapter.requests import CORE_OUTPUTS
from pagedserve.backend.triton_adapter.relay_model import RelayModel

from .fakes import FINAL, CharTokenizer, FakeEngineThread, FakePbUtils, Request, TritonError, wait_until

TOKENIZER = CharTokenizer()


class EngineOverBLS:
    """llm_engine as `llm` reaches it: each BLS call becomes a Request to a real EngineModel,
    and the call's iterator yields what that request's sender sends. Stream requests wait
    for `admit` (set by default), so a test can let a cancel arrive first."""

    def __init__(self):
        self.engine_thread = FakeEngineThread()
        self.pb_utils = FakePbUtils(self)
        self.model = EngineModel(self.pb_utils, self.engine_thread, TOKENIZER, lambda: None)  # no metrics: stats unused
        self.cancel_ids: list[str] = []
        self.streams: list[Request] = []
        self.admit = threading.Event()
        self.admit.set()

    def __call__(self, bls):
        request = Request(bls.inputs, request_id=bls.request_id, parameters=json.dumps(bls.parameters or {}),
                          outputs=bls.requested_output_names)
        if "cancel_request_id" in bls.inputs:
            self.cancel_ids.append(bls.inputs["cancel_request_id"][0].decode())
        else:
            self.streams.append(request)
            assert self.admit.wait(5)
        self.model.execute([request])
        return request.sender.stream()

    def request_id(self, prompt: str = "") -> str:
        """The id `llm` gave llm_engine for the (only, or `prompt`'s) stream."""
        def matching():
            return [r.request_id for r in self.pb_utils.bls_requests if "input_ids" in r.inputs
                    and (not prompt or r.inputs["input_ids"].tolist() == [ord(c) for c in prompt])]
        wait_until(lambda: len(matching()) == 1)
        return matching()[0]

    def emit(self, texts: list[str], prompt: str = "", finish: bool = True, **last) -> None:
        """Engine outputs of the stream (of `prompt`), one per text, the last one finished."""
        request_id = self.request_id(prompt)
        wait_until(lambda: request_id in self.engine_thread.callbacks)
        for i, text in enumerate(texts):
            final = finish and i == len(texts) - 1
            self.engine_thread.emit(request_id, [ord(c) for c in text], finished=final, **(last if final else {}))

    def drained(self) -> bool:
        """Every stream llm_engine answered has ended (its iterator was read to the end)."""
        return bool(self.streams) and all(r.sender.updates.empty() and r.sender.done.is_set() for r in self.streams)


def texts(sender) -> list[str]:
    return [b"".join(r.outputs()["text_output"]).decode() for r in sender.responses if not r.has_error()]


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    """finalize() waits until drained streams may be let go: not seconds, in tests."""
    monkeypatch.setattr(relay_model, "ITERATOR_GRACE_S", 0.05)


@pytest.fixture
def engine():
    engine = EngineOverBLS()
    yield engine
    engine.model.finalize()


@pytest.fixture
def model(engine):
    model = RelayModel(engine.pb_utils, TOKENIZER)
    yield model
    model.finalize()


def test_streams_text_deltas_with_the_final_flag_on_the_last(engine, model):
    request = Request({"text_input": "Hi", "stream": True, "max_tokens": 4}, parameters='{"seed": 1}')
    model.execute([request])
    engine.emit(["Hel", "lo!"])
    sent = request.sender.wait_final()
    assert texts(request.sender) == ["Hel", "lo!"] and [f for _, f in sent] == [0, FINAL]  # the engine's ack stays inside
    forwarded = engine.pb_utils.bls_requests[0]
    assert forwarded.model_name == "llm" and set(forwarded.requested_output_names) == {*CORE_OUTPUTS, "error"}
    assert forwarded.inputs["input_ids"].tolist() == [ord("H"), ord("i")] and "text_input" not in forwarded.inputs
    assert forwarded.inputs["max_tokens"].tolist() == [4] and forwarded.parameters == {"seed": 1}
    assert forwarded.inputs["bls_caller"].tolist() == [True]
    wait_until(lambda: engine.drained() and not model.active)


def test_invalid_prompt_is_invalid_arg_and_the_model_keeps_serving(engine, model):
    bad, good = Request({"text_input": ""}), Request({"text_input": "x"})
    model.execute([bad, good])
    (response, flags), = bad.sender.wait_final()
    assert flags == FINAL and response.error().code() == TritonError.INVALID_ARG
    assert "'text_input'" in response.error().message()
    engine.emit(["ok"])
    good.sender.wait_final()
    assert texts(good.sender) == ["xok"]  # not streaming: the prompt comes first, as in vLLM's backend
    assert len(engine.pb_utils.bls_requests) == 1


def test_an_engine_failure_mid_stream_reaches_the_client_as_its_final(engine, model):
    """A later BLS error response would be lost on 2.51: llm_engine sends it as data."""
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    engine.emit(["a", ""], finish_reason="error", error="RuntimeError: step failed")
    sent = request.sender.wait_final()
    assert texts(request.sender) == ["a"] and sent[-1][1] == FINAL
    assert sent[-1][0].error().code() == TritonError.INTERNAL
    assert sent[-1][0].error().message() == "engine failure: RuntimeError: step failed"
    wait_until(lambda: engine.drained())


def test_a_client_gone_mid_stream_gets_a_final_and_the_engine_stops(engine, model):
    request = Request({"text_input": "x", "stream": True})
    request.sender.fail_after = 1
    model.execute([request])
    request_id = engine.request_id()
    engine.emit(["a", "b"], finish=False)
    sent = request.sender.wait_final()
    assert texts(request.sender) == ["a"] and sent[-1] == (None, FINAL) and request.sender.finals == 1
    wait_until(lambda: engine.cancel_ids == [request_id] and engine.engine_thread.aborted == [request_id])
    wait_until(lambda: engine.drained() and not model.active)


def test_client_cancellation_aborts_in_the_engine(engine, model):
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    request_id = engine.request_id()
    wait_until(lambda: request_id in engine.engine_thread.callbacks)
    request.sender.cancelled = True
    sent = request.sender.wait_final()
    assert engine.cancel_ids == [request_id] and engine.engine_thread.aborted == [request_id]
    assert sent[-1] == (None, FINAL) and request.sender.finals == 1  # a flag-only final, as the vLLM backend sends
    wait_until(lambda: engine.drained())
    assert not request.sender.asked_after_final


def test_a_cancel_that_reaches_the_engine_before_its_request_ends_it_there(engine, model):
    engine.admit.clear()  # the stream's BLS call is slower than the cancel
    request = Request({"text_input": "x", "stream": True})
    request.sender.cancelled = True
    model.execute([request])
    request_id = engine.request_id()
    wait_until(lambda: engine.cancel_ids == [request_id])
    engine.admit.set()
    sent = request.sender.wait_final()
    assert sent == [(None, FINAL)]
    assert request_id not in engine.engine_thread.submitted
    wait_until(lambda: engine.drained())


def test_an_exception_in_the_relay_ends_the_request_cancels_and_drains(engine, model, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("cannot decode")

    monkeypatch.setattr(contracts, "text_response", broken)
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    request_id = engine.request_id()
    engine.emit(["a", "b"])
    (response, flags), = request.sender.wait_final()
    assert flags == FINAL and response.error().message() == "ValueError: cannot decode"
    wait_until(lambda: engine.cancel_ids == [request_id] and engine.drained())


def test_drained_streams_are_kept_a_while_then_released_by_the_watcher(engine, model, monkeypatch):
    monkeypatch.setattr(relay_model, "ITERATOR_GRACE_S", 1.0)
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    engine.emit(["a"])
    request.sender.wait_final()
    wait_until(lambda: len(model.drained) == 1)
    wait_until(lambda: not model.drained)


@pytest.mark.parametrize("flag, output", [("return_finish_reason", "finish_reason"),
                                          ("return_cumulative_logprob", "cumulative_logprob"),
                                          ("return_logprobs", "logprobs"),
                                          ("return_num_input_tokens", "num_input_tokens"),
                                          ("return_num_output_tokens", "num_output_tokens")])
@pytest.mark.parametrize("on", [True, False, None])
def test_an_output_comes_only_when_its_flag_is_set(engine, model, flag, output, on):
    inputs = {"text_input": "x", "stream": True} | ({} if on is None else {flag: on})
    request = Request(inputs)
    model.execute([request])
    engine.emit(["a", "b"])
    request.sender.wait_final()
    asked = engine.pb_utils.bls_requests[0].requested_output_names
    assert (output in asked) is bool(on)
    assert [sorted(r.outputs()) for r in request.sender.responses] == [sorted(["text_output"] + ([output] if on else []))] * 2


def test_a_client_naming_outputs_gets_only_those(engine, model):
    request = Request({"text_input": "x", "stream": True, "return_finish_reason": True, "return_num_output_tokens": True},
                      outputs=["finish_reason"])
    model.execute([request])
    engine.emit(["ab", "c"])
    request.sender.wait_final()
    assert "num_output_tokens" not in engine.pb_utils.bls_requests[0].requested_output_names
    assert [r.outputs() for r in request.sender.responses] == [{"finish_reason": [b"None"]}, {"finish_reason": [b"length"]}]


def test_output_values_follow_the_vllm_backend(engine, model):
    request = Request({"text_input": "x", "stream": True, "return_finish_reason": True, "return_logprobs": True,
                       "return_num_input_tokens": True, "return_num_output_tokens": True})
    model.execute([request])
    engine.emit(["ab", "c"])
    request.sender.wait_final()
    outputs = [r.outputs() for r in request.sender.responses]
    assert [o["finish_reason"].tolist() for o in outputs] == [[b"None"], [b"length"]]
    assert [o["num_output_tokens"].tolist() for o in outputs] == [[2], [1]]
    assert [o["num_input_tokens"].tolist() for o in outputs] == [[1], [1]]
    assert [o["logprobs"].tolist() for o in outputs] == [[b"null"], [b"null"]]  # no `logprobs` sampling parameter


def test_finalize_cancels_in_flight_requests(engine):
    model = RelayModel(engine.pb_utils, TOKENIZER)
    request = Request({"text_input": "x", "stream": True})
    model.execute([request])
    request_id = engine.request_id()
    wait_until(lambda: request_id in engine.engine_thread.callbacks)
    model.finalize()
    assert engine.cancel_ids == [request_id]
    assert request.sender.wait_final()[-1][0].error().code() == TritonError.CANCELLED
    assert engine.drained() and not model.watcher.is_alive()


def test_a_failing_cancellation_check_does_not_stop_the_watcher(engine, model):
    broken, cancelled = Request({"text_input": "x", "stream": True}), Request({"text_input": "y", "stream": True})

    def is_cancelled():
        raise RuntimeError("stub gone")

    broken.sender.is_cancelled = is_cancelled
    model.execute([broken, cancelled])
    cancelled_id = engine.request_id("y")
    wait_until(lambda: cancelled_id in engine.engine_thread.callbacks)
    cancelled.sender.cancelled = True
    assert cancelled.sender.wait_final()[-1] == (None, FINAL)
    engine.emit(["z"], prompt="x")
    broken.sender.wait_final()


def _sample(text: str, index: int, finished: bool = False, reason: str | None = None):
    from pagedserve.backend.outputs import RequestOutput

    return RequestOutput("", [ord(c) for c in text], [], "", finished, reason, index=index,
                         num_output_tokens=len(text), cumulative_logprob=-float(index + 1))


@pytest.mark.parametrize("stream", [True, False])
def test_n_samples_come_as_one_entry_each_in_sample_order(engine, model, stream):
    """vLLM's backend with n: each response holds every sample's delta; FINAL rides on
    the response where the last sample ends; finish_reason is "None" until a sample ends."""
    request = Request({"text_input": "x", "stream": stream, "return_finish_reason": True,
                       "return_num_output_tokens": True, "return_num_input_tokens": True,
                       "return_cumulative_logprob": True, "sampling_parameters": '{"n": 2}'})
    model.execute([request])
    request_id = engine.request_id()
    wait_until(lambda: request_id in engine.engine_thread.callbacks)
    assert engine.engine_thread.submitted[request_id][1].n == 2
    engine.engine_thread.emit(request_id, [], samples=[_sample("ab", 0), _sample("c", 1)])
    engine.engine_thread.emit(request_id, [], samples=[_sample("", 0, True, "stop"), _sample("de", 1)])
    engine.engine_thread.emit(request_id, [], finished=True, samples=[_sample("", 0, True, "stop"),
                                                                       _sample("f", 1, True, "length")])
    sent = request.sender.wait_final()
    outputs = [r.outputs() for r in request.sender.responses]
    if stream:
        assert [o["text_output"].tolist() for o in outputs] == [[b"ab", b"c"], [b"", b"de"], [b"", b"f"]]
        assert [o["finish_reason"].tolist() for o in outputs] == [[b"None", b"None"], [b"stop", b"None"],
                                                                   [b"stop", b"length"]]
        assert [o["num_output_tokens"].tolist() for o in outputs] == [[2, 1], [0, 2], [0, 1]]
        assert [f for _, f in sent] == [0, 0, FINAL]
    else:
        (only,) = outputs
        assert only["text_output"].tolist() == [b"xab", b"xcdef"]  # the prompt leads each sample, as in vLLM's backend
        assert only["finish_reason"].tolist() == [b"stop", b"length"]
        assert only["num_output_tokens"].tolist() == [2, 4]
    assert outputs[-1]["num_input_tokens"].tolist() == [1]
    assert outputs[-1]["cumulative_logprob"].tolist() == [-1.0, -2.0]
