"""`pagedserve openai` in front of a real tritonserver, driven by the official `openai` SDK.

The gateway is its own process (as users run it); the server has room for 32 streams
at once (the session server of conftest.py keeps a small queue for its busy tests).
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

from pagedserve.backend.model_files import resolve_model_path
from pagedserve.backend.tokenizer import apply_chat_template, encode_prompt, load_tokenizer
from pagedserve.client.process import http_status
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from .conftest import ENGINE, gateway_process, llm_inputs, stream_request, tensor, texts, wait_idle

KEY = "test-key"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("openai_triton")
    engine = ENGINE | {"max_num_seqs": "32", "max_queue_size": "32"}
    server = TritonServer(write_repository(workdir / "model_repository", engine=engine), log_file=workdir / "tritonserver.log")
    server.start(timeout=300)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(triton, tmp_path_factory):
    """Base URL of `pagedserve openai` (API key required)."""
    log = tmp_path_factory.mktemp("openai_gateway") / "gateway.log"
    command = [sys.executable, "-m", "pagedserve.client.cli", "openai", "--triton-url", triton.grpc_url, "--api-key", KEY]
    with gateway_process(command, log) as url:
        yield url


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(""))


def streamed_chat(client, **kwargs):
    """(text per choice, finish reason per choice, usage) of a streamed chat completion."""
    texts_, reasons, usage = {}, {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts_[choice.index] = texts_.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return texts_, reasons, usage


def test_chat_streamed_equals_not_streamed_with_exact_usage(client, tokenizer):
    whole = client.chat.completions.create(model="llm", messages=CHAT, max_tokens=24, temperature=0)
    streamed, reasons, usage = streamed_chat(client, model="llm", messages=CHAT, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.system_fingerprint
    assert whole.choices[0].message.role == "assistant"
    assert streamed == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason} and whole.choices[0].finish_reason in ("stop", "length")
    prompt_tokens = len(apply_chat_template(tokenizer, CHAT))
    generated = len(tokenizer.encode(whole.choices[0].message.content, add_special_tokens=False))
    assert whole.usage.prompt_tokens == usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.total_tokens == prompt_tokens + whole.usage.completion_tokens
    assert abs(whole.usage.completion_tokens - generated) <= 1  # the EOS token counts, and is not text


def test_completion_streamed_equals_not_streamed_and_counts_forced_tokens(client, tokenizer):
    prompt = "The three primary colours are"
    whole = client.completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    pieces = list(client.completions.create(model="llm", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert whole.object == "text_completion"
    assert "".join(c.choices[0].text for c in pieces if c.choices) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(encode_prompt(tokenizer, prompt))
    assert whole.usage.completion_tokens == 12 == pieces[-1].usage.completion_tokens


def test_a_stream_interval_gathers_tokens_and_continuous_usage_counts_them(client):
    chunks = list(client.completions.create(
        model="llm", prompt="Count: one, two,", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "stream_interval": 4}))
    texts = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in texts] == [1, 5, 9, 10]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_a_chat_streams_running_usage_from_its_role_chunk_on(client):
    chunks = list(client.chat.completions.create(
        model="llm", messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (prompt_tokens, 0)
    assert [c.usage.completion_tokens for c in chunks[1:-1]] == [1, 2, 3, 4, 5]
    assert prompt_tokens > 0 and chunks[-1].usage.completion_tokens == 5


def test_echo_puts_the_prompt_in_front(client):
    prompt = "Once upon a time"
    plain = client.completions.create(model="llm", prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="llm", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="llm", prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True))
    assert echoed.choices[0].text == prompt + plain.choices[0].text == streamed


def test_n_samples_are_choices_with_their_own_text(client):
    reply = client.chat.completions.create(model="llm", messages=CHAT, max_tokens=16, temperature=1.0, seed=7, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    streamed, _, usage = streamed_chat(client, model="llm", messages=CHAT, max_tokens=16, temperature=1.0, seed=7, n=2)
    assert streamed == {c.index: c.message.content for c in reply.choices}
    assert usage.completion_tokens == reply.usage.completion_tokens
    many = client.completions.create(model="llm", prompt=["Red is", "Blue is"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy: both samples of a prompt agree


def test_stop_string_ends_the_text_before_it(client):
    free = client.completions.create(model="llm", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    stop = free.strip().split()[1]  # a word the free run produces
    cut = client.completions.create(model="llm", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]


def test_logprobs_chat_and_completions(client):
    reply = client.chat.completions.create(model="llm", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the sampled token is the top one
        assert token.bytes == list(token.token.encode())
    done = client.completions.create(model="llm", prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert "".join(logprobs.tokens) == done.choices[0].text and len(logprobs.token_logprobs) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_refusals_are_openai_errors_naming_the_parameter(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llm", messages=CHAT, temperature=5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as refused:  # the engine's own check, through Triton
        client.chat.completions.create(model="llm", messages=CHAT, extra_body={"repetition_penalty": 0})
    assert "repetition_penalty" in refused.value.message
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model="llm", messages=CHAT, tools=[{"type": "function", "function": {"name": "a b"}}])
    assert tools.value.body["param"] == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError) as streamed:  # refused before the stream starts: a status, not an event
        client.chat.completions.create(model="llm", messages=CHAT, stream=True, extra_body={"top_k": -5})
    assert streamed.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as template:  # chat_template_kwargs reach the served model's template
        client.chat.completions.create(model="llm", messages=CHAT, extra_body={"chat_template_kwargs": {"tools": []}})
    assert "chat_template_kwargs" in template.value.message
    assert client.chat.completions.create(model="llm", messages=CHAT, max_tokens=2, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message.content
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert missing.value.body["code"] == "model_not_found"


def test_the_api_key_guards_every_route_but_health(gateway):
    wrong = openai.OpenAI(base_url=f"{gateway}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="llm", messages=CHAT)
    assert http_status(f"{gateway}/health") == http_status(f"{gateway}/health/ready") == 200
    right = openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY)
    assert [m.id for m in right.models.list()] == ["llm"]
    assert right.models.retrieve("llm").id == "llm"
    assert right.models.retrieve("llm").model_extra["input_modalities"] == ["text"]  # a text model


def aborted_in_engine(triton) -> int:
    return Path(triton.log_file).read_text(errors="replace").count("[pagedserve] aborted request")


def wait_aborted(triton, count: int) -> None:
    """Until the engine logged `count` aborts (the request was cancelled, not finished) and is idle."""
    import time

    deadline = time.monotonic() + 30
    while aborted_in_engine(triton) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted_in_engine(triton) == count
    wait_idle(triton, timeout=30)


def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(client, triton):
    aborted = aborted_in_engine(triton)
    stream = client.chat.completions.create(model="llm", messages=CHAT, max_tokens=800, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_aborted(triton, aborted + 1)
    # a plain HTTP client that gives up on a non-streamed request and drops its connection
    body = json.dumps({"model": "llm", "messages": CHAT, "max_tokens": 800, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{client.base_url}chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(request, timeout=1.5)
    wait_aborted(triton, aborted + 2)


def test_32_async_streams_at_once_match_the_grpc_path(gateway, triton):
    async def one(client, seed):
        text = ""
        stream = await client.chat.completions.create(
            model="llm", messages=CHAT, max_tokens=24, temperature=0.8, seed=seed, stream=True)
        async for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return text

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, seed) for seed in range(32)))

    through_gateway = asyncio.run(all_of_them())
    assert all(through_gateway)
    for seed in (0, 13, 31):  # the gateway asks for the model's defaults (the bundled model's top_p) too
        results, error = stream_request(triton, llm_inputs(messages=CHAT, max_tokens=24, temperature=0.8, seed=seed,
                                                           use_model_defaults=True))
        assert error is None
        assert "".join(texts(results)) == through_gateway[seed]
    wait_idle(triton)


@pytest.mark.parametrize("stream", [True, False])
def test_llm_answers_what_tritons_own_openai_frontend_sends_and_reads(triton, tokenizer, stream):
    """The request of Triton's OpenAI frontend (`--backend vllm`, NVIDIA's container): a
    chat rendered to text, sampling keys with its defaults, the three return_* flags;
    it reads one `text_output`, UINT32 token counts in every response (the output count
    summed over a stream), and logprobs whose lowest-rank entry is the selected token."""
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    sampling = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "temperature": 0.0, "top_p": 1.0, "n": 1,
                "ignore_eos": False, "max_tokens": 16, "seed": 3, "stop": "\n\n", "logprobs": 1}
    inputs = [tensor("text_input", prompt), tensor("stream", stream), tensor("exclude_input_in_output", True),
              tensor("sampling_parameters", json.dumps(sampling)), tensor("return_logprobs", True),
              tensor("return_num_input_tokens", True), tensor("return_num_output_tokens", True)]
    results, error = stream_request(triton, inputs)
    assert error is None
    assert results[-1].get_response().parameters["triton_final_response"].bool_param
    if not stream:
        assert len(results) in (1, 2)
    output_tokens, selected = 0, ""
    for result in results:
        assert result.as_numpy("text_output").shape == (1,)
        assert result.as_numpy("num_input_tokens").dtype == np.uint32
        assert int(result.as_numpy("num_input_tokens")[0]) == len(encode_prompt(tokenizer, prompt))
        count = int(result.as_numpy("num_output_tokens")[0])
        positions = json.loads(result.as_numpy("logprobs")[0])
        assert len(positions) == count
        selected += "".join(min(p.values(), key=lambda e: e["rank"])["decoded_token"] for p in positions)
        output_tokens += count
    assert 0 < output_tokens <= 16
    assert selected.startswith("".join(texts(results)))  # greedy: the top token is the sampled one (EOS adds "<|im_end|>")


def test_the_load_generator_speaks_openai(gateway, monkeypatch):
    """`pagedserve bench --protocol openai`: token counts exact through the usage chunk."""
    from pagedserve.client.loadgen import BenchConfig, run_benchmark

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    config = BenchConfig(url=gateway, protocol="openai", num_requests=4, concurrency=2, prompt_len_mean=32,
                         prompt_len_range=0, output_len=8, warmup=0)
    summary = run_benchmark(config, progress=False).summary
    assert (summary.num_errors, summary.total_output_tokens, summary.total_prompt_tokens) == (0, 32, 4 * 32)


def test_json_schema_response_format_and_the_sdks_parse_helper(client):
    """The openai SDK unchanged: `parse` with a Pydantic model sends a strict json_schema
    response_format and parses the answer; json_object gives an object; a schema that does not
    compile is a 400."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=99)

    for seed in range(2):
        parsed = client.chat.completions.parse(model="llm", messages=CHAT, response_format=Person, max_tokens=120,
                                               temperature=1.0, seed=seed)
        assert isinstance(parsed.choices[0].message.parsed, Person)
    ask = [{"role": "user", "content": "Reply with a JSON object with one key, colour."}]
    answer = client.chat.completions.create(model="llm", messages=ask, max_tokens=300, temperature=0,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llm", messages=CHAT, max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "does not compile" in bad.value.message


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
         "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": CLOCK}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo, and what time is it in UTC?"}]


def valid_calls(message) -> list[str]:
    """The called functions' names, each call's arguments checked against its parameters."""
    import jsonschema

    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [call.function.name for call in message.tool_calls]


def test_tool_choice_required_and_named_call_with_valid_arguments_streamed_or_not(client):
    """The openai SDK unchanged: `required` and a named function are enforced by grammar at
    temperature 1.0, so the calls parse and validate whatever the model; streamed, the SDK
    assembles them from the deltas; `none` calls nothing; a past call and its result can be
    sent back."""
    for seed in range(3):
        answer = client.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        assert answer.choices[0].finish_reason == "tool_calls" and len(valid_calls(answer.choices[0].message)) == 1
        with client.chat.completions.stream(model="llm", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].finish_reason == "tool_calls" and len(valid_calls(final.choices[0].message)) == 1
    # parallel calls: as many as the model writes before max_tokens; each whole one is returned, and valid
    several = client.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=120, temperature=1.0, seed=5)
    assert valid_calls(several.choices[0].message)
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        if stream:
            with client.chat.completions.stream(model="llm", messages=ASK, tools=TOOLS, tool_choice=named,
                                                max_tokens=60, temperature=1.0, seed=7, n=2) as events:
                answer = events.get_final_completion()
        else:
            answer = client.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice=named,
                                                    max_tokens=60, temperature=1.0, seed=7, n=2)
        assert len(answer.choices) == 2
        assert all(valid_calls(choice.message) == ["get_time"] and not choice.message.content
                   for choice in answer.choices)
    plain = client.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    call = answer.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = client.chat.completions.create(model="llm", messages=history, tools=TOOLS, max_tokens=12)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llm", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert bad.value.body["param"] == "tool_choice.function.name"


def test_30_seeded_requests_over_the_schemas_regexes_and_grammar_validate(client):
    """The gateway's share of the 200-request sweep (test_structured_output_served.py has
    the rest): `response_format` json_schema, vLLM's guided_regex / guided_grammar, at
    temperature 1.0; every answer parses and validates."""
    from concurrent.futures import ThreadPoolExecutor

    from .structured_cases import CASES, prompt

    def run(index: int) -> None:
        case = CASES[index % len(CASES)]
        if case.kind == "json":
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": case.spec}}}
        else:
            extra = {"extra_body": {f"guided_{case.kind}": case.spec}}
        answer = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": prompt(index)}],
                                                max_tokens=160, temperature=1.0, seed=index, **extra)
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        case.check(answer.choices[0].message.content)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(run, range(170, 200)))
