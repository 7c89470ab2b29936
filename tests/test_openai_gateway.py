"""The OpenAI gateway's translation, without a server: OpenAI fields -> `llm` inputs,
Triton errors -> OpenAI statuses, vLLM-backend logprobs -> OpenAI logprobs."""

from __future__ import annotations

import json

import pytest

from pagedserve.client.openai_gateway import GatewayConfig, GatewayConfigError
from pagedserve.client.openai_gateway.errors import OpenAIError, from_triton
from pagedserve.client.openai_gateway.schemas import ChatCompletionRequest, CompletionRequest
from pagedserve.client.openai_gateway.translate import chat_request, completion_requests
from pagedserve.client.openai_gateway.triton_stream import _token_logprobs


def chat(**fields):
    return ChatCompletionRequest(model="llm", messages=[{"role": "user", "content": "hi"}], **fields)


def test_chat_fields_become_vllm_sampling_parameters():
    request = chat(max_completion_tokens=9, max_tokens=3, temperature=0.2, n=2, stop="END", seed=4, logprobs=True,
                   top_logprobs=2, top_k=5)
    sent = chat_request(request, default_max_tokens=16)
    inputs = sent.inputs()
    assert json.loads(inputs["messages"]) == [{"role": "user", "content": "hi"}]
    assert json.loads(inputs["sampling_parameters"]) == {
        "max_tokens": 9, "temperature": 0.2, "n": 2, "seed": 4, "top_k": 5, "stop": ["END"], "logprobs": 2}
    assert inputs["return_logprobs"] and inputs["return_num_input_tokens"] and inputs["exclude_input_in_output"]
    assert json.loads(chat_request(chat(), 16).inputs()["sampling_parameters"]) == {"max_tokens": 16, "n": 1}


def test_generation_config_auto_asks_for_the_models_defaults():
    """vLLM's --generation-config: auto (the default) sends `use_model_defaults`, so the served
    model's generation_config.json fills the fields a request leaves out; vllm sends nothing more."""
    assert GatewayConfig().generation_config == "auto"
    with pytest.raises(GatewayConfigError, match="generation_config.*'model'"):
        GatewayConfig(generation_config="model")
    sent = json.loads(chat_request(chat(temperature=0.3), 16, model_defaults=True).inputs()["sampling_parameters"])
    assert sent == {"max_tokens": 16, "n": 1, "temperature": 0.3, "use_model_defaults": True}
    prompts = completion_requests(CompletionRequest(model="llm", prompt=["a", "b"]), 16, model_defaults=True)
    assert all(json.loads(r.inputs()["sampling_parameters"])["use_model_defaults"] for r in prompts)
    assert "use_model_defaults" not in json.loads(chat_request(chat(), 16).inputs()["sampling_parameters"])


def test_vllms_stream_interval_is_passed_on_and_checked():
    sent = chat_request(chat(stream=True, stream_interval=4), 16).inputs()
    assert json.loads(sent["sampling_parameters"])["stream_interval"] == 4
    with pytest.raises(ValueError, match="stream_interval"):
        chat(stream_interval=0)


def test_text_parts_are_joined_and_developer_reads_as_system():
    request = ChatCompletionRequest(model="llm", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert chat_request(request, 16).messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("fields, param", [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     "messages[0].content"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields, param):
    request = ChatCompletionRequest(**({"model": "llm", "messages": [{"role": "user", "content": "hi"}]} | fields))
    with pytest.raises(OpenAIError) as refused:
        chat_request(request, 16)
    assert refused.value.status == 400 and refused.value.param == param


def test_neutral_values_of_unsupported_fields_are_accepted():
    chat_request(chat(tools=[], tool_choice="none", response_format={"type": "text"}, user="u", store=False), 16)


def test_a_list_of_prompts_fans_out_and_token_prompts_are_refused():
    sent = completion_requests(CompletionRequest(model="llm", prompt=["a", "b"], echo=True, logprobs=0), 16)
    assert [r.text for r in sent] == ["a", "b"] and all(r.top_logprobs == 0 for r in sent)
    assert sent[0].inputs()["exclude_input_in_output"] is False  # echo, not streamed: the server prepends
    with pytest.raises(OpenAIError, match="prompt"):
        completion_requests(CompletionRequest(model="llm", prompt=[1, 2, 3]), 16)


@pytest.mark.parametrize("message, status, param", [
    ("'temperature': must be >= 0, got -1", 400, "temperature"),
    ("Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.", 400, None),
    ("server busy: 8 requests are waiting (max_queue_size=8); retry later", 503, None),
    ("Request for unknown model: 'llm' is not found", 503, None),
    ("engine failure: RuntimeError: boom", 500, None),
])
def test_triton_errors_get_fitting_statuses(message, status, param):
    error = from_triton(message)
    assert (error.status, error.param) == (status, param)
    assert error.body()["error"]["message"] == message


def test_logprobs_take_the_first_entry_as_sampled_and_rank_the_rest():
    raw = json.dumps([{"12": {"logprob": -1.5, "rank": 3, "decoded_token": "c"},
                       "10": {"logprob": -0.2, "rank": 1, "decoded_token": "a"},
                       "11": {"logprob": -0.4, "rank": 2, "decoded_token": "b"}}])
    (token,) = _token_logprobs(raw, top=2)
    assert (token.token, token.logprob, token.top) == ("c", -1.5, [("a", -0.2), ("b", -0.4)])
    assert _token_logprobs("null", top=0) == []


def test_gateway_settings_are_checked_once():
    assert GatewayConfig(served_model_name="smol").model_ids() == {"smol": "llm"}
    with pytest.raises(GatewayConfigError, match="triton_url"):
        GatewayConfig(triton_url="localhost")
    with pytest.raises(GatewayConfigError, match="served_model_name"):
        GatewayConfig(models=["a", "b"], served_model_name="x")


def test_lora_adapters_are_models_of_their_own():
    """An adapter's model id goes to the Triton model that serves it, with its lora_name."""
    config = GatewayConfig(models=["llm", "other"], lora_modules=["sql", "chat=other"])
    assert config.model_ids() == {"llm": "llm", "other": "other", "sql": "llm", "chat": "other"}
    assert config.adapters() == {"sql": ("llm", "sql"), "chat": ("other", "chat")}
    for bad in (["llm"], ["x=nowhere"], ["a", "a"], ["=llm"]):
        with pytest.raises(GatewayConfigError, match="--lora-module"):
            GatewayConfig(lora_modules=bad)


def test_prompts_times_n_is_capped_before_any_request_is_built():
    sent = completion_requests(CompletionRequest(model="llm", prompt=["a", "b"], n=2), 16, max_choices=4)
    assert len(sent) == 2
    with pytest.raises(OpenAIError) as refused:
        completion_requests(CompletionRequest(model="llm", prompt=["a", "b", "c"], n=2), 16, max_choices=4)
    assert (refused.value.status, refused.value.param) == (400, "n")
    assert "max_choices_per_request" in refused.value.message and "--max-choices-per-request" in refused.value.message
    with pytest.raises(OpenAIError, match="max_choices_per_request"):
        chat_request(chat(n=5), 16, max_choices=4)
    with pytest.raises(OpenAIError, match="token-id prompts"):  # a token-id prompt is not counted as prompts
        completion_requests(CompletionRequest(model="llm", prompt=list(range(100))), 16, max_choices=4)


def test_a_grpc_failure_does_not_tell_the_client_where_triton_is(caplog):
    import asyncio

    import grpc

    from pagedserve.client.openai_gateway.translate import LLMRequest
    from pagedserve.client.openai_gateway.triton_stream import TritonLLM

    class Unreachable(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "failed to connect to all addresses; last error: triton.internal:8001"

    async def attempt(code):
        triton = TritonLLM("triton.internal:8001")

        async def results(*_):
            raise Unreachable(code)
            yield  # an async generator

        triton.llm.results = results
        try:
            async for _ in triton.stream("llm", LLMRequest(text="hi")):
                pass
        finally:
            await triton.close()

    for code, status in ((grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.INTERNAL, 500)):
        with pytest.raises(OpenAIError) as failed:
            asyncio.run(attempt(code))
        assert failed.value.status == status and "triton.internal" not in failed.value.message
    assert "triton.internal:8001" in caplog.text  # the operator still finds it in the log


def test_response_format_and_vllms_grammar_fields_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}},
         {"structured_outputs": {"json": schema}}),
        ({"guided_choice": ["a", "b"]}, {"guided_choice": ["a", "b"]}),
        ({"structured_outputs": {"regex": "x+"}, "response_format": {"type": "text"}}, {"structured_outputs": {"regex": "x+"}}),
    ]
    for fields, expected in cases:
        request = ChatCompletionRequest(**({"model": "llm", "messages": [{"role": "user", "content": "hi"}]} | fields))
        sampling = chat_request(request, 16).sampling
        assert {k: v for k, v in sampling.items() if k in expected} == expected
