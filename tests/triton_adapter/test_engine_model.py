"""The engine's model's request lifecycle (`llm`: token ids, and text in-process),
driven by a fake engine thread (no model load)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedserve.backend.errors import EngineDeadError, QueueFullError
from pagedserve.backend.triton_adapter.engine_model import EngineModel, TextEngineModel
from pagedserve.backend.triton_adapter.metrics import EngineMetrics

from .conftest import STATS
from .fakes import FINAL, CharTokenizer, FakeEngineThread, FakePbUtils, Logger, Request, TritonError, submit, wait_until


def test_streaming_request_gets_one_response_per_output_with_final_on_the_last(model, engine_thread):
    request = submit(model, engine_thread, stream=True, return_num_output_tokens=True, return_finish_reason=True)
    engine_thread.emit("r1", [10, 11])
    engine_thread.emit("r1", [12], finished=True)
    sent = request.sender.wait_final()
    assert [f for _, f in sent] == [0, FINAL]
    outputs = [r.outputs() for r, _ in sent]
    assert [o["output_ids"].tolist() for o in outputs] == [[10, 11], [12]]
    assert [o["finished"].tolist() for o in outputs] == [[False], [True]]
    assert [o["num_output_tokens"].tolist() for o in outputs] == [[2], [1]]
    assert outputs[-1]["finish_reason"].tolist() == [b"length"]  # STRING outputs travel as bytes


def test_non_streaming_request_gets_one_merged_response(model, engine_thread):
    request = submit(model, engine_thread, return_num_input_tokens=True)
    for ids in ([10], [11, 12]):
        engine_thread.emit("r1", ids)
    engine_thread.emit("r1", [13], finished=True)
    sent = request.sender.wait_final()
    assert len(sent) == 1 and sent[0][1] == FINAL
    outputs = sent[0][0].outputs()
    assert outputs["output_ids"].tolist() == [5, 6, 7, 10, 11, 12, 13]  # the prompt too, as vLLM does unless excluded
    assert outputs["num_input_tokens"].tolist() == [3]


def test_invalid_request_gets_invalid_arg_naming_the_field_and_the_model_keeps_serving(model, engine_thread):
    bad = Request({"input_ids": [5], "sampling_parameters": "{not json"}, request_id="bad")
    missing = Request({"stream": True}, request_id="missing")
    model.execute([bad, missing])
    for request, field in ((bad, "sampling_parameters"), (missing, "input_ids")):
        (response, flags), = request.sender.wait_final()
        assert flags == FINAL
        assert response.error().code() == TritonError.INVALID_ARG
        assert f"'{field}'" in response.error().message()
    assert "bad" not in engine_thread.submitted and not model.active

    good = submit(model, engine_thread, request_id="good", stream=True)
    engine_thread.emit("good", [9], finished=True)
    assert good.sender.wait_final()[0][0].outputs()["output_ids"].tolist() == [9]


@pytest.mark.parametrize(
    "error, code",
    [
        (QueueFullError("server busy: the waiting queue is full"), TritonError.UNAVAILABLE),
        (EngineDeadError("the engine failed earlier"), TritonError.UNAVAILABLE),
        (RuntimeError("boom"), TritonError.INTERNAL),
    ],
)
def test_submit_failures_map_to_triton_codes(error, code):
    pb_utils = FakePbUtils()
    model = EngineModel(pb_utils, FakeEngineThread(submit_error=error), CharTokenizer(), lambda: STATS)
    try:
        request = Request({"input_ids": [1, 2]}, request_id="r")
        model.execute([request])
        (response, flags), = request.sender.wait_final()
        assert flags == FINAL and response.error().code() == code
        assert str(error) in response.error().message()
        assert not model.active
    finally:
        model.finalize()


def test_cancelled_client_aborts_in_the_engine_and_gets_cancelled(model, engine_thread):
    request = submit(model, engine_thread, stream=True)
    engine_thread.emit("r1", [10])
    request.sender.cancelled = True
    sent = request.sender.wait_final()
    assert engine_thread.aborted == ["r1"]
    assert sent[-1][0].error().code() == TritonError.CANCELLED and sent[-1][1] == FINAL
    assert "[pagedserve] aborted request r1 in the engine after its client cancelled it; its KV blocks are free" in Logger.lines
    wait_until(lambda: not model.active)
    assert not request.sender.asked_after_final


def bls_error_code(response) -> str:
    return json.loads(response.outputs()["error"].reshape(-1)[0])["code"]


def test_cancel_control_request_aborts_the_named_relay_request(model, engine_thread):
    target = submit(model, engine_thread, request_id="target", stream=True, bls_caller=True)
    control = Request({"cancel_request_id": "target", "bls_caller": True})
    model.execute([control])
    assert control.sender.sent == [(None, FINAL)]
    assert bls_error_code(target.sender.wait_final()[-1][0]) == "CANCELLED"
    assert engine_thread.aborted == ["target"]


def test_a_clients_own_request_cannot_be_cancelled_by_id_by_anyone_else(model, engine_thread):
    """`cancel_request_id` is the relays' plumbing: it names only their (random-id) requests. A
    client's request, whatever id it carries, ends by its own cancellation or its own end."""
    victim = submit(model, engine_thread, request_id="victim", stream=True)
    model.execute([Request({"cancel_request_id": "victim"}), Request({"cancel_request_id": "victim", "bls_caller": True})])
    model.execute([Request({"cancel_request_id": "future"})])
    future = submit(model, engine_thread, request_id="future", stream=True)  # not refused on arrival
    assert engine_thread.aborted == [] and {"victim", "future"} <= set(engine_thread.submitted)
    engine_thread.emit("victim", [1], finished=True)
    engine_thread.emit("future", [1], finished=True)
    assert victim.sender.wait_final()[-1][1] == FINAL and future.sender.wait_final()[-1][1] == FINAL
    assert victim.sender.sent[-1][0].error() is None


def test_a_cancel_before_its_request_refuses_the_request_on_arrival(model, engine_thread):
    control = Request({"cancel_request_id": "early", "bls_caller": True})
    model.execute([control])
    assert control.sender.sent == [(None, FINAL)]
    late = submit(model, engine_thread, request_id="early", stream=True, bls_caller=True)
    (response, flags), = late.sender.wait_final()
    assert flags == FINAL and bls_error_code(response) == "CANCELLED"
    assert not engine_thread.submitted and not model.active
    again = submit(model, engine_thread, request_id="early", stream=True)  # remembered once only
    assert "early" in engine_thread.submitted
    engine_thread.emit("early", [1], finished=True)
    assert again.sender.wait_final()[0][0].outputs()["finished"].tolist() == [True]


def test_engine_failure_is_an_internal_error(model, engine_thread):
    request = submit(model, engine_thread, stream=True)
    engine_thread.emit("r1", [], finished=True, finish_reason="error", error="RuntimeError: step failed")
    (response, flags), = request.sender.wait_final()
    assert flags == FINAL and response.error().code() == TritonError.INTERNAL
    assert "step failed" in response.error().message()


def test_reused_request_ids_are_served_separately(model, engine_thread):
    first = submit(model, engine_thread, request_id="same", stream=True)
    second = submit(model, engine_thread, request_id="same", stream=True)
    assert len(engine_thread.submitted) == 2
    for request_id, sender in zip(engine_thread.submitted, (first.sender, second.sender)):
        engine_thread.emit(request_id, [ord("x")], finished=True)
        assert sender.wait_final()[0][0].outputs()["finished"].tolist() == [True]


def test_finalize_aborts_in_flight_requests(engine_thread):
    model = EngineModel(FakePbUtils(), engine_thread, CharTokenizer(), lambda: STATS)
    requests = [submit(model, engine_thread, request_id=f"r{i}", stream=True) for i in range(2)]
    model.finalize()
    assert engine_thread.shut_down
    for request in requests:
        assert request.sender.wait_final(0)[-1][0].error().code() == TritonError.CANCELLED
    assert not model.response_thread.is_alive() and not model.watcher.is_alive()


def test_metrics_count_what_a_request_used(model, engine_thread):
    request = submit(model, engine_thread, stream=True)
    engine_thread.emit("r1", [10], num_output_tokens=1)
    engine_thread.emit("r1", [11, 12], num_output_tokens=3)
    engine_thread.emit("r1", [13], finished=True, num_output_tokens=4)
    request.sender.wait_final()
    metrics = model.metrics
    wait_until(lambda: metrics.running.total == STATS.num_running)
    vllm = metrics.vllm
    assert vllm.prompt_tokens.total == 3
    assert vllm.generation_tokens.total == 4
    assert len(vllm.ttft.observations) == len(vllm.e2e.observations) == 1 and len(vllm.tpot.observations) == 2
    assert vllm.e2e.observations[0] >= vllm.ttft.observations[0] >= 0
    assert (metrics.waiting.total, metrics.blocks_used.total, metrics.blocks_total.total) == (1, 10, 64)
    assert metrics.max_running.total == 3 and metrics.hit_rate.total == 0.5


def test_triton_request_parameters_act_as_sampling_parameters(model, engine_thread):
    request = Request({"input_ids": [1]}, request_id="p", parameters=json.dumps({"max_tokens": 3, "temperature": 0}))
    model.execute([request])
    params = engine_thread.submitted["p"][1]
    assert (params.max_tokens, params.temperature) == (3, 0)
    assert np.array_equal(engine_thread.submitted["p"][0], [1])


def test_the_models_generation_config_fills_what_a_request_asking_for_it_leaves_out(engine_thread):
    """`use_model_defaults` (the OpenAI gateway's): the checkpoint's temperature and top_p where the
    request is silent, its own values where it is not; without it vLLM's defaults, as Triton's vLLM
    backend gives them."""
    model = EngineModel(FakePbUtils(), engine_thread, CharTokenizer(), lambda: STATS,
                        model_defaults={"temperature": 0.6, "top_p": 0.9})
    for request_id, sampling in (("d", {"use_model_defaults": True, "top_p": 0.5}), ("v", {}),
                                 ("s", {"use_model_defaults": "true"})):
        model.execute([Request({"input_ids": [1], "sampling_parameters": json.dumps(sampling)}, request_id=request_id)])
    wait_until(lambda: len(engine_thread.submitted) == 3)
    got = {key: (params.temperature, params.top_p) for key, (_, params) in
           ((key, engine_thread.submitted[key][:2]) for key in "dvs")}
    assert got == {"d": (0.6, 0.5), "v": (1.0, 1.0), "s": (0.6, 0.9)}
    bad = Request({"input_ids": [1], "sampling_parameters": json.dumps({"use_model_defaults": "maybe"})}, request_id="b")
    model.execute([bad])
    assert "'use_model_defaults': must be true or false" in bad.sender.wait_final()[-1][0].error().message()
    model.finalize()


def test_bls_callers_are_not_asked_whether_they_were_cancelled(model, engine_thread):
    request = submit(model, engine_thread, stream=True, bls_caller=True)
    request.sender.is_cancelled = lambda: pytest.fail("asked a BLS caller")  # `llm` sends cancel requests instead
    model.watcher.tick()
    engine_thread.emit("r1", [1], finished=True)
    request.sender.wait_final()


def test_a_failed_send_mid_stream_aborts_and_still_ends_the_request(model, engine_thread):
    request = submit(model, engine_thread, stream=True)
    request.sender.fail_after = 0
    engine_thread.emit("r1", [10])
    request.sender.wait_final()
    assert engine_thread.aborted == ["r1"] and request.sender.finals == 1 and not request.sender.sent
    wait_until(lambda: not model.active)


def test_a_failed_final_send_still_closes_the_request(model, engine_thread):
    request = submit(model, engine_thread, stream=True)
    request.sender.fail_final = True
    engine_thread.emit("r1", [10], finished=True)
    request.sender.wait_final()
    assert request.sender.finals == 1 and not model.active


def test_a_final_output_that_cannot_be_built_ends_with_an_error(model, engine_thread, monkeypatch):
    from pagedserve.backend.triton_adapter import engine_model

    request = submit(model, engine_thread, stream=True)

    def broken(*args):
        raise ValueError("bad output")

    monkeypatch.setattr(engine_model, "engine_response", broken)
    engine_thread.emit("r1", [10], finished=True)
    (response, flags), = request.sender.wait_final()
    assert flags == FINAL and "ValueError: bad output" in response.error().message()


def test_the_watcher_outlives_failures(engine_thread):
    def failing_stats():
        raise RuntimeError("stats unavailable")

    pb_utils = FakePbUtils()
    model = EngineModel(pb_utils, engine_thread, CharTokenizer(), failing_stats, EngineMetrics(pb_utils, {"model": "m", "version": "1"}))
    try:
        broken, cancelled = submit(model, engine_thread, "broken", stream=True), submit(model, engine_thread, "c", stream=True)

        def is_cancelled():
            raise RuntimeError("stub gone")

        broken.sender.is_cancelled = is_cancelled
        cancelled.sender.cancelled = True
        assert cancelled.sender.wait_final()[-1][0].error().code() == TritonError.CANCELLED
        assert model.watcher.is_alive()
    finally:
        model.finalize()


@pytest.fixture
def text_model(engine_thread):
    model = TextEngineModel(FakePbUtils(), engine_thread, CharTokenizer(), lambda: STATS)
    yield model
    model.finalize()


def text_of(response) -> str:
    return b"".join(response.outputs()["text_output"]).decode()


def test_text_requests_are_tokenized_and_answered_with_text_deltas_in_process(text_model, engine_thread):
    request = Request({"text_input": "Hi", "stream": True, "sampling_parameters": '{"max_tokens": 4}'},
                      request_id="t", outputs=["text_output"])
    text_model.execute([request])
    prompt, params = engine_thread.submitted["t"]
    assert prompt == [ord("H"), ord("i")] and params.max_tokens == 4
    engine_thread.emit("t", [ord("H"), ord("e")])
    engine_thread.emit("t", [ord("y")], finished=True)
    sent = request.sender.wait_final()
    assert [text_of(r) for r, _ in sent] == ["He", "y"] and [f for _, f in sent] == [0, FINAL]
    assert set(sent[0][0].outputs()) == {"text_output"}  # no token-level tensors reach a text client


def test_token_requests_to_the_text_model_get_token_ids(text_model, engine_thread):
    request = submit(text_model, engine_thread, stream=True)
    engine_thread.emit("r1", [10], finished=True)
    (response, flags), = request.sender.wait_final()
    assert response.outputs()["output_ids"].tolist() == [10] and "text_output" not in response.outputs()


def test_a_bad_text_request_names_the_field(text_model, engine_thread):
    request = Request({"stream": True}, request_id="empty", outputs=["text_output"])
    text_model.execute([request])
    (response, flags), = request.sender.wait_final()
    assert flags == FINAL and response.error().code() == TritonError.INVALID_ARG
    assert "text_input" in response.error().message() and not engine_thread.submitted


def test_a_cancelled_text_client_gets_a_final_without_outputs(text_model, engine_thread):
    request = Request({"text_input": "Hi", "stream": True}, request_id="c", outputs=["text_output"])
    text_model.execute([request])
    engine_thread.emit("c", [ord("a")])
    request.sender.cancelled = True
    sent = request.sender.wait_final()
    assert engine_thread.aborted == ["c"]
    assert sent[-1] == (None, FINAL)  # as vLLM's backend ends a cancelled request
    wait_until(lambda: not text_model.active)


def test_ids_the_server_makes_cannot_be_guessed(model, engine_thread):
    """A request without an id (or reusing one in flight) gets one the server makes, which
    `cancel_request_id` names: not a counter another client could walk through."""
    for _ in range(3):
        submit(model, engine_thread, request_id="", stream=True)
    made = list(engine_thread.submitted)[-3:]
    assert len(set(made)) == 3 and all(m.startswith("req#") and len(m) == len("req#") + 16 for m in made)
    assert not any(m.endswith(("#0", "#1", "#2")) for m in made)


def test_the_model_is_ready_while_its_engine_serves_and_the_gauge_says_so(engine_thread):
    pb_utils = FakePbUtils()
    metrics = EngineMetrics(pb_utils, {"model": "llm", "version": "1"})
    model = EngineModel(pb_utils, engine_thread, CharTokenizer(), lambda: STATS, metrics)
    try:
        assert model.is_ready()
        engine_thread.is_ready = False  # its recovery failed, or a step hangs
        assert not model.is_ready()
        model.next_gauges = 0.0
        wait_until(lambda: metrics.ready.total == 0)
    finally:
        model.finalize()
