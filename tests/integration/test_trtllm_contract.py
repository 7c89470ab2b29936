"""TensorRT-LLM's contract on a real tritonserver: the `ensemble` (preprocessing ->
tensorrt_llm -> postprocessing), `tensorrt_llm_bls` and `tensorrt_llm`, with its tensor
names and [1, 1] shapes, as its clients send them."""

from __future__ import annotations

import queue
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from pagedserve.backend import SamplingParams

from .conftest import llm_inputs, metric, stream_request, tensor, texts
from .test_llm_http import post, sse_events

TEXT_MODELS = ("ensemble", "tensorrt_llm_bls")


def trt_inputs(prompt: str, max_tokens: int, **values) -> list:
    """Text-level inputs as TensorRT-LLM's clients send them: every tensor [1, 1] (words [1, K])."""
    inputs = [tensor("text_input", prompt, shape=[1, 1]), tensor("max_tokens", max_tokens, shape=[1, 1])]
    for name, value in values.items():
        if isinstance(value, list):
            inputs.append(tensor(name, value, shape=[1, len(value)]))
        else:
            dtype = "UINT64" if name == "seed" else None
            inputs.append(tensor(name, value, dtype=dtype, shape=[1, 1]))
    return inputs


def trt_text(server, model: str, prompt: str, max_tokens: int, **values) -> list[str]:
    results, error = stream_request(server, trt_inputs(prompt, max_tokens, **values), model=model)
    assert error is None, error
    return [r.as_numpy("text_output")[0].decode() for r in results if r.as_numpy("text_output") is not None]


def chat_text(engine, question: str) -> str:
    """A chat rendered as plain text: the ensemble takes text as TensorRT-LLM's does."""
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("question", ["Translate to Japanese: good morning", "Reply with three emoji about the sea."])
def test_streamed_text_is_exact_and_equals_llm_and_offline(server, engine, model, question):
    prompt = chat_text(engine, question)
    deltas = trt_text(server, model, prompt, 40, stream=True)
    assert len(deltas) > 5 and not any("\ufffd" in d for d in deltas)
    [offline] = engine.generate([engine.encode(prompt)], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    assert "".join(deltas) == offline.text
    llm, error = stream_request(server, llm_inputs(prompt, max_tokens=40, temperature=0))
    assert error is None and "".join(texts(llm)) == offline.text
    assert trt_text(server, model, prompt, 40, stream=False, exclude_input_in_output=True) == [offline.text]


def test_leading_spaces_survive_per_delta_and_non_streamed_text_echoes_the_prompt(server, engine):
    prompt = "The capital of France is"
    deltas = trt_text(server, "ensemble", prompt, 12, stream=True)
    [offline] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert deltas[0].startswith(" ") and "".join(deltas) == offline.text
    assert trt_text(server, "ensemble", prompt, 12, exclude_input_in_output=False) == [prompt + offline.text]


def test_http_generate_stream_on_the_ensemble(server, engine):
    body = {"text_input": "List three fruits:", "max_tokens": 20, "stream": True}
    events = sse_events(post(server, "/v2/models/ensemble/generate_stream", body))
    [offline] = engine.generate(["List three fruits:"], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert "".join(e["text_output"] for e in events) == offline.text


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_inputs_change_the_output_as_in_tensorrt_llm(server, engine, model):
    prompt = "The capital of France is"
    [offline] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert "Paris" in offline.text
    # stop words end the text (and stay in it, as there); max_tokens bounds it
    stopped = "".join(trt_text(server, model, prompt, 12, stream=True, stop_words=[" Paris"]))
    assert stopped == offline.text[: offline.text.index(" Paris") + len(" Paris")]
    assert len(engine.encode(trt_text(server, model, prompt, 3, exclude_input_in_output=True)[0])) <= 3
    # bad words never appear
    banned = "".join(trt_text(server, model, prompt, 12, bad_words=[" Paris"]))
    assert "Paris" not in banned and banned
    # a seed reproduces a sampled output
    sampled = [trt_text(server, model, prompt, 12, top_k=40, temperature=1.5, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]
    # two sequences come back as two responses, told apart by sequence_index
    results, error = stream_request(server, trt_inputs(prompt, 8, num_return_sequences=2, top_k=50, temperature=1.5, seed=3), model=model)
    assert error is None and sorted(int(r.as_numpy("sequence_index")[0][0]) for r in results) == [0, 1]
    # log probs: one per generated token, summing to the cumulative one
    [result], error = stream_request(server, trt_inputs(prompt, 5, return_log_probs=True), model=model)
    per_token, cumulative = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
    assert error is None and per_token.shape == (1, 1, 5) and np.isclose(per_token.sum(), cumulative[0][0], atol=1e-3)


@pytest.mark.parametrize("name,value", [("beam_width", 2), ("return_generation_logits", True), ("lora_task_id", 5)])
def test_inputs_we_cannot_honour_are_refused_by_name(server, name, value):
    """lora_task_id N asks for the adapter multi_lora.json lists as "N": this server serves none."""
    dtype = "UINT64" if name == "lora_task_id" else None
    inputs = trt_inputs("Hi", 4) + [tensor(name, value, dtype=dtype, shape=[1, 1])]
    expected = "'lora_name': this model serves no adapters (asked for '5')" if name == "lora_task_id" else f"'{name}'"
    for model in TEXT_MODELS:
        _, error = stream_request(server, inputs, model=model)
        assert error is not None and expected in str(error)
    assert trt_text(server, "ensemble", "Hi", 2)  # and the server keeps serving


def test_the_steps_one_by_one_equal_the_ensemble(server, engine):
    """As TensorRT-LLM's end_to_end_test does: preprocessing -> tensorrt_llm -> postprocessing."""
    prompt = "Name a color:"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    pre = client.infer("preprocessing", [tensor("QUERY", prompt, shape=[1, 1]), tensor("REQUEST_OUTPUT_LEN", 10, shape=[1, 1])])
    ids, length = pre.as_numpy("INPUT_ID"), pre.as_numpy("REQUEST_INPUT_LEN")
    assert ids.tolist() == [engine.encode(prompt)] and length.tolist() == [[len(engine.encode(prompt))]]
    inputs = [tensor("input_ids", ids.tolist()[0], shape=list(ids.shape)), tensor("input_lengths", length.tolist()[0], shape=[1, 1]),
              tensor("request_output_len", 10, shape=[1, 1])]
    [generated], error = stream_request(server, inputs, model="tensorrt_llm")
    assert error is None
    output_ids, lengths = generated.as_numpy("output_ids"), generated.as_numpy("sequence_length")
    [offline] = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    everything = engine.encode(prompt) + offline.token_ids  # TensorRT-LLM's default: the prompt comes along
    assert output_ids.tolist() == [[everything]] and lengths.tolist() == [[len(everything)]]
    post_result = client.infer("postprocessing", [tensor("TOKENS_BATCH", everything, shape=[1, 1, len(everything)]),
                                                  tensor("SEQUENCE_LENGTH", len(everything), shape=[1, 1])])
    assert post_result.as_numpy("OUTPUT")[0].decode() == prompt + offline.text == trt_text(server, "ensemble", prompt, 10)[0]
    client.close()


def test_tensorrt_llm_stop_request_ends_a_running_request(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    request_id = uuid.uuid4().hex
    base = [tensor("input_ids", [504, 3575, 282], shape=[1, 3]), tensor("input_lengths", 3, shape=[1, 1])]
    client.async_stream_infer("tensorrt_llm", base + [tensor("request_output_len", 500, shape=[1, 1]),
                                                      tensor("streaming", True, shape=[1, 1])], request_id=request_id)
    results.get(timeout=60)  # it runs
    client.async_stream_infer("tensorrt_llm", base + [tensor("request_output_len", 1, shape=[1, 1]),
                                                      tensor("stop", True, shape=[1, 1])], request_id=request_id)
    seen, cancelled = 1, False
    while not cancelled:
        result, error = results.get(timeout=60)
        cancelled = error is not None and "cancel" in str(error).lower()
        seen += 1
    client.stop_stream()
    client.close()
    assert seen < 500


def test_tensorrt_llm_metric_families_are_exported(server):
    assert metric(server, "nv_trt_llm_kv_cache_block_metrics") > 0  # max, free, tokens_per ... summed
    assert metric(server, "nv_trt_llm_request_metrics") >= 0
    assert metric(server, "nv_trt_llm_inflight_batcher_metrics") >= 0

