"""TensorRT-LLM's contract: word lists, its inputs read into sampling settings, and the
`tensorrt_llm` / `tensorrt_llm_bls` relays over llm_engine (fake BLS, as test_relay_model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedserve.backend.errors import InvalidRequestError
from pagedserve.backend.outputs import RequestOutput
from pagedserve.backend.triton_adapter.relay_model import TrtllmBlsModel, TrtllmEngineModel
from pagedserve.backend.triton_adapter.trtllm import TEXT_NAMES, TOKEN_NAMES, from_word_list, parse_trtllm_request, to_word_list

from .fakes import FINAL, Request, TritonError, wait_until
from .test_relay_model import TOKENIZER, engine, short_grace  # noqa: F401 (fixtures)


def test_word_lists_round_trip_in_tensorrt_llms_format():
    words = [[5, 6], [7]]
    assert to_word_list(words).tolist() == [[5, 6, 7], [2, 3, -1]]
    assert to_word_list([]).tolist() == [[0], [-1]]
    assert from_word_list("stop_words_list", to_word_list(words)[np.newaxis]) == words
    assert from_word_list("stop_words_list", [[0], [-1]]) == []
    with pytest.raises(InvalidRequestError, match="stop_words_list"):
        from_word_list("stop_words_list", [[1, 2], [3, -1]])


def arrays(**values):
    return {k: np.asarray(v) for k, v in values.items()}


def test_sampling_defaults_are_tensorrt_llms_greedy_unless_top_k_or_top_p_samples():
    greedy = parse_trtllm_request(arrays(max_tokens=[[8]], temperature=[[0.7]]), TEXT_NAMES, [], [], True)
    assert greedy.sampling["temperature"] == 0.0 and greedy.sampling["max_tokens"] == 8
    sampled = parse_trtllm_request(arrays(request_output_len=[4], runtime_top_k=[5], runtime_top_p=[0.0], num_return_sequences=[2]),
                                   TOKEN_NAMES, ["END"], [[9]], True)
    assert sampled.sampling["top_k"] == 5 and sampled.sampling["top_p"] == 1.0 and sampled.sampling["n"] == 2
    assert sampled.sampling["stop"] == ["END"] and sampled.sampling["include_stop_str_in_output"] is True
    assert sampled.sampling["bad_words_ids"] == [[9]] and "temperature" not in sampled.sampling


def test_unsupported_inputs_are_refused_by_name_and_neutral_values_accepted():
    ok = arrays(max_tokens=[[4]], beam_width=[[1]], return_context_logits=[[False]], length_penalty=[[1.3]])
    parse_trtllm_request(ok, TEXT_NAMES, [], [], True)
    for name, value in (("beam_width", [[2]]), ("lora_weights", [[0.5]]), ("return_generation_logits", [[True]])):
        with pytest.raises(InvalidRequestError, match=f"'{name}'"):
            parse_trtllm_request(arrays(max_tokens=[[4]], **{name: value}), TEXT_NAMES, [], [], True)
    # lora_task_id N: the adapter multi_lora.json lists as "N" (the engine checks that it exists)
    assert parse_trtllm_request(arrays(max_tokens=[[4]], lora_task_id=[[3]]), TEXT_NAMES, [], [], True).sampling["lora_name"] == "3"
    with pytest.raises(InvalidRequestError, match="'request_output_len': is required"):
        parse_trtllm_request(arrays(), TOKEN_NAMES, [], [], True)


@pytest.fixture
def relay(engine):
    """Makes relay models over the fake llm_engine; finalized before it, as Triton unloads them."""
    made = []

    def make(cls):
        made.append(cls(engine.pb_utils, TOKENIZER))
        return made[-1]

    yield make
    for model in made:
        model.finalize()


def test_tensorrt_llm_streams_output_ids_per_sequence_with_context_for_exact_text(engine, relay):
    model = relay(TrtllmEngineModel)
    request = Request({"input_ids": [[72, 105]], "input_lengths": [2], "request_output_len": [3], "streaming": [True],
                       "stop_words_list": [[[33], [1]]], "num_return_sequences": [2], "runtime_top_k": [4]})
    model.execute([request])
    forwarded = engine.pb_utils.bls_requests[0]
    sampling = json.loads(forwarded.inputs["sampling_parameters"][0])
    assert sampling["stop"] == ["!"] and sampling["n"] == 2 and forwarded.inputs["input_ids"].tolist() == [72, 105]
    request_id = engine.request_id()
    wait_until(lambda: request_id in engine.engine_thread.callbacks)
    sample = lambda ids, ctx, done: RequestOutput(request_id, ids, ctx, "", done, "length" if done else None, num_prompt_tokens=2)
    engine.engine_thread.callbacks[request_id](
        RequestOutput(request_id, [], [], "", False, None, num_prompt_tokens=2,
                      samples=[sample([111], [105], False), sample([], [], False)]))
    engine.engine_thread.callbacks.pop(request_id)(
        RequestOutput(request_id, [], [], "", True, "length", num_prompt_tokens=2,
                      samples=[sample([107], [111], True), sample([97], [105], True)]))
    sent = request.sender.wait_final()
    outs = [r.outputs() for r, _ in sent]
    assert [(o["sequence_index"].tolist(), o["output_ids"].tolist(), o["context_ids"].tolist()) for o in outs] == [
        ([[0]], [[[111]]], [[[105]]]), ([[0]], [[[107]]], [[[111]]]), ([[1]], [[[97]]], [[[105]]])]
    assert [f for _, f in sent] == [0, 0, FINAL] and outs[0]["sequence_length"].tolist() == [[1]]


def test_a_stop_request_ends_the_request_of_the_same_id(engine, relay):
    model = relay(TrtllmEngineModel)
    running = Request({"input_ids": [[72]], "request_output_len": [50], "streaming": [True]}, request_id="42")
    model.execute([running])
    request_id = engine.request_id()
    stop = Request({"input_ids": [[72]], "request_output_len": [1], "stop": [True]}, request_id="42")
    model.execute([stop])
    assert stop.sender.wait_final()[-1][1] == FINAL
    wait_until(lambda: engine.cancel_ids == [request_id])
    unknown = Request({"input_ids": [[72]], "request_output_len": [1], "stop": [True]}, request_id="7")
    model.execute([unknown])
    (response, _), = unknown.sender.wait_final()
    assert response.error().code() == TritonError.INVALID_ARG and "'stop'" in response.error().message()


def test_tensorrt_llm_bls_sends_text_1d_as_its_clients_read_it(engine, relay):
    model = relay(TrtllmBlsModel)
    request = Request({"text_input": [["Hi"]], "max_tokens": [[2]], "stream": [[False]], "return_log_probs": [[True]]})
    model.execute([request])
    engine.emit(["ok"])
    (response, flags), = request.sender.wait_final()
    assert flags == FINAL and response.outputs()["text_output"].tolist() == [b"Hiok"]  # the prompt comes along by default, as there
    assert response.outputs()["cum_log_probs"].shape == (1, 1)
    assert json.loads(engine.pb_utils.bls_requests[0].inputs["sampling_parameters"][0])["logprobs"] == 0


def test_guided_decoding_inputs_become_structured_outputs():
    from pagedserve.backend.triton_adapter.trtllm import guided_decoding

    def arrays(**values):
        return {name: np.array([value.encode()], dtype=np.object_) for name, value in values.items()}

    assert guided_decoding({}) == {}
    assert guided_decoding(arrays(guided_decoding_guide_type="json")) == {"structured_outputs": {"json_object": True}}
    assert guided_decoding(arrays(guided_decoding_guide_type="json_schema", guided_decoding_guide='{"type": "object"}')) == {
        "structured_outputs": {"json": '{"type": "object"}'}}
    assert guided_decoding(arrays(guided_decoding_guide_type="ebnf_grammar", guided_decoding_guide='root ::= "a"')) == {
        "structured_outputs": {"grammar": 'root ::= "a"'}}
    for bad, field in ((arrays(guided_decoding_guide_type="xml", guided_decoding_guide="x"), "guided_decoding_guide_type"),
                       (arrays(guided_decoding_guide_type="regex"), "guided_decoding_guide"),
                       (arrays(guided_decoding_guide="a+"), "guided_decoding_guide_type")):
        with pytest.raises(InvalidRequestError) as refused:
            guided_decoding(bad)
        assert refused.value.field == field
