"""llm_engine's output contract (Triton's vLLM backend): an output only when requested and
its return_* flag is set, vLLM's values and wording, and what a BLS caller gets instead of
error responses."""

from __future__ import annotations

import json

import pytest

from .fakes import Request, TritonError, submit

RETURNS = {"return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
           "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
           "return_num_output_tokens": "num_output_tokens"}
CORE = ["context_ids", "context_lengths", "finished", "output_ids", "output_lengths", "skip_special_tokens", "trim_chars"]


@pytest.mark.parametrize("flag", sorted(RETURNS))
@pytest.mark.parametrize("on", [True, False, None])
def test_an_output_is_sent_only_when_its_flag_is_set(model, engine_thread, flag, on):
    request = submit(model, engine_thread, stream=True, **({} if on is None else {flag: on}))
    engine_thread.emit("r1", [10])
    engine_thread.emit("r1", [11], finished=True)
    request.sender.wait_final()
    expected = sorted(CORE + ([RETURNS[flag]] if on else []))
    assert [sorted(r.outputs()) for r in request.sender.responses] == [expected] * 2


def test_only_the_requested_outputs_are_built(model, engine_thread):
    request = Request({"input_ids": [5], "return_finish_reason": True, "return_num_input_tokens": True},
                      request_id="r1", outputs=["output_ids", "finish_reason"])
    model.execute([request])
    engine_thread.emit("r1", [10], finished=True)
    (response, flags), = request.sender.wait_final()
    assert sorted(response.outputs()) == ["finish_reason", "output_ids"]


def test_values_follow_the_vllm_backend(model, engine_thread):
    """finish_reason "None" until the last; cumulative_logprob cumulative; logprobs null without
    the `logprobs` sampling parameter; num_output_tokens per response."""
    from pagedserve.backend.sequence import TokenLogprob

    request = submit(model, engine_thread, stream=True, return_finish_reason=True, return_cumulative_logprob=True,
                     return_logprobs=True, return_num_output_tokens=True)
    assert engine_thread.submitted["r1"][1].logprobs == 0  # computed, for the cumulative
    engine_thread.emit("r1", [10, 11], cumulative_logprob=-0.5, logprobs=[TokenLogprob(10, -0.2, 1, []), TokenLogprob(11, -0.3, 1, [])])
    engine_thread.emit("r1", [12], finished=True, cumulative_logprob=-0.75, logprobs=[TokenLogprob(12, -0.25, 1, [])])
    request.sender.wait_final()
    outputs = [r.outputs() for r in request.sender.responses]
    assert [o["finish_reason"].tolist() for o in outputs] == [[b"None"], [b"length"]]
    assert [o["cumulative_logprob"].tolist() for o in outputs] == [[-0.5], [-0.75]]
    assert [o["logprobs"].tolist() for o in outputs] == [[b"null"], [b"null"]]
    assert [o["num_output_tokens"].tolist() for o in outputs] == [[2], [1]]

    asked = Request({"input_ids": [5], "stream": True, "return_logprobs": True, "sampling_parameters": '{"logprobs": 1}'},
                    request_id="r2")
    model.execute([asked])
    engine_thread.emit("r2", [10], finished=True, logprobs=[TokenLogprob(10, -0.2, 1, [])])
    (response, _), = asked.sender.wait_final()
    assert json.loads(response.outputs()["logprobs"][0]) == [{"10": {"logprob": -0.2, "rank": 1, "decoded_token": "\n"}}]


def test_logprobs_list_the_sampled_token_first_then_the_top_ones_by_rank(model, engine_thread):
    """As vLLM v1 orders them: OpenAI gateways read the first entry as the sampled token."""
    from pagedserve.backend.sequence import TokenLogprob

    asked = Request({"input_ids": [5], "stream": True, "return_logprobs": True, "sampling_parameters": '{"logprobs": 2}'},
                    request_id="r3")
    model.execute([asked])
    engine_thread.emit("r3", [12, 10], finished=True, logprobs=[
        TokenLogprob(12, -1.5, 3, [(10, -0.2), (11, -0.4)]),  # sampled outside the top 2
        TokenLogprob(10, -0.2, 1, [(10, -0.2), (11, -0.4)]),  # sampled the top one: listed once
    ])
    (response, _), = asked.sender.wait_final()
    positions = json.loads(response.outputs()["logprobs"][0])
    assert [list(p) for p in positions] == [["12", "10", "11"], ["10", "11"]]
    assert [[e["rank"] for e in p.values()] for p in positions] == [[3, 1, 2], [1, 2]]


def test_streaming_without_excluding_the_input_reads_as_the_vllm_backend(model, engine_thread):
    request = submit(model, engine_thread, stream=True, exclude_input_in_output=False)
    (response, _), = request.sender.wait_final()
    assert response.error().message() == "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    assert response.error().code() == TritonError.INVALID_ARG


def test_a_bls_caller_is_acknowledged_at_once_and_gets_errors_as_data(model, engine_thread):
    """Triton 2.51 loses a BLS error response after the first: none is ever sent to `llm`."""
    running = submit(model, engine_thread, request_id="run", stream=True, bls_caller=True)
    assert running.sender.sent == [(running.sender.sent[0][0], 0)] and not running.sender.sent[0][0].outputs()
    engine_thread.emit("run", [10])
    engine_thread.emit("run", [], finished=True, finish_reason="error", error="RuntimeError: step failed")
    invalid = submit(model, engine_thread, request_id="bad", stream=True, bls_caller=True, exclude_input_in_output=False)
    cancelled = submit(model, engine_thread, request_id="gone", stream=True, bls_caller=True)
    model.execute([Request({"cancel_request_id": "gone", "bls_caller": True})])
    codes = []
    for request in (running, invalid, cancelled):
        sent = request.sender.wait_final()
        assert not any(r.has_error() for r, _ in sent if r is not None)
        codes.append(json.loads(sent[-1][0].outputs()["error"][0])["code"])
    assert codes == ["INTERNAL", "INVALID_ARG", "CANCELLED"]
