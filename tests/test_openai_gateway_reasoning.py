"""Reasoning in the gateway, without a server: a reasoning model's text told apart into the
message's `reasoning` and its answer (`<think>` tags; gpt-oss's Harmony channels and tool calls),
whole and streamed in pieces split anywhere; what a request's chat_template_kwargs and
include_reasoning change; the fields as the openai SDK reads them."""

from __future__ import annotations

import json

import pytest

from pagedserve.client.openai_gateway import GatewayConfig, GatewayConfigError
from pagedserve.client.openai_gateway.errors import OpenAIError
from pagedserve.client.openai_gateway.responses import Accumulator, ResponseHeader, StreamedReplies, chat_chunks, chat_completion
from pagedserve.client.openai_gateway.schemas import ChatCompletionRequest
from pagedserve.client.openai_gateway.translate import chat_request
from pagedserve.client.openai_gateway.triton_stream import LLMStep, SampleDelta

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
QWEN3 = "<think>\nThe user greets me.\n</think>\n\nHello!"
R1 = "Two and two make four.</think>The answer is 4."
HARMONY_ANSWER = ("<|channel|>analysis<|message|>User asks for 2+2.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>4<|return|>")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')


def step(text: str, finish_reason: str | None = None) -> LLMStep:
    """One `llm` response moving the one choice on by `text`."""
    return LLMStep([SampleDelta(text, finish_reason, 1)], 1, finish_reason is not None)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="llm", messages=[{"role": "user", "content": "hi"}], **fields)


def served(text: str, parser: str | None, pieces: int | None = None, **fields) -> tuple[dict, list[dict]]:
    """The message a choice's `text` becomes (whole), and the deltas of it streamed in
    `pieces`-character pieces (the last with the finish reason)."""
    sent = chat_request(request(**fields), 64, reasoning_parser=parser)
    result = Accumulator()
    size = pieces or len(text)
    parts = [text[at:at + size] for at in range(0, len(text), size)] or [""]
    replies = StreamedReplies(sent.reply()) if sent.reply() is not None else None
    deltas = []
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        llm_step = step(part, "stop" if last else None)
        result.add(llm_step)
        for chunk in chat_chunks(ResponseHeader.new("c", "llm"), llm_step, replies):
            deltas.append(chunk.model_dump()["choices"][0])
    whole = chat_completion(ResponseHeader.new("c", "llm"), result, sent.reply()).model_dump()["choices"][0]
    return whole, deltas


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d["delta"].get(key) or "" for d in deltas)


@pytest.mark.parametrize("parser, text, reasoning, answer", [
    ("qwen3", QWEN3, "\nThe user greets me.\n", "\n\nHello!"),
    ("deepseek_r1", R1, "Two and two make four.", "The answer is 4."),
    ("deepseek_r1", "<think>" + R1, "Two and two make four.", "The answer is 4."),
    ("openai_gptoss", HARMONY_ANSWER, "User asks for 2+2.", "4"),
])
def test_reasoning_is_told_from_the_answer_whole_and_streamed(parser, text, reasoning, answer):
    """Whole, and streamed one character at a time or in pieces of 2, 3 and 7: the same reasoning
    (under both field names) and answer, no tag leaking into either."""
    for pieces in (None, 1, 2, 3, 7):
        whole, deltas = served(text, parser, pieces)
        message = whole["message"]
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == (reasoning, reasoning, answer)
        assert joined(deltas, "reasoning") == joined(deltas, "reasoning_content") == reasoning
        assert joined(deltas, "content") == answer and deltas[-1]["finish_reason"] == "stop"


def test_without_a_parser_or_with_thinking_off_the_text_is_the_answer():
    """No reasoning parser: the text as it is, and no reasoning field at all; Qwen3 asked not to
    think (chat_template_kwargs, which go to the template as they are) answers without a think."""
    whole, deltas = served(QWEN3, None, 3)
    assert whole["message"]["content"] == QWEN3 and "reasoning" not in whole["message"]
    assert joined(deltas, "content") == QWEN3 and all("reasoning" not in d["delta"] for d in deltas)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole, _ = served("Hello!", "qwen3", **off)
    assert whole["message"]["content"] == "Hello!" and "reasoning" not in whole["message"]
    sent = chat_request(request(**off), 64, reasoning_parser="qwen3")
    assert json.loads(sent.inputs()["chat_template_kwargs"]) == {"enable_thinking": False} and sent.reply() is None


def test_reasoning_cut_short_stays_reasoning_and_include_reasoning_false_drops_it():
    whole, _ = served("<think>Still thinking about it", "qwen3", 4)
    assert whole["message"]["reasoning"] == "Still thinking about it" and whole["message"]["content"] == ""
    whole, deltas = served(QWEN3, "qwen3", 5, include_reasoning=False)
    assert "reasoning" not in whole["message"] and whole["message"]["content"] == "\n\nHello!"
    assert joined(deltas, "content") == "\n\nHello!" and not joined(deltas, "reasoning")


@pytest.mark.parametrize("parser, tool_parser", [("openai_gptoss", "auto"), (None, "openai")])
def test_harmony_tool_calls_are_tool_calls(parser, tool_parser):
    """gpt-oss calling a tool (its reasoning parser, or its tool-call parser alone): the analysis
    is reasoning, the message to functions.get_weather a call with its JSON arguments, the
    finish reason tool_calls; special tokens are kept in the text it is read from."""
    sent = chat_request(request(tools=TOOLS), 64, tool_call_parser=tool_parser, reasoning_parser=parser)
    assert json.loads(sent.inputs()["sampling_parameters"])["skip_special_tokens"] is False
    for pieces in (None, 1, 4, 9):
        result = Accumulator()
        result.add(step(HARMONY_CALL, "stop"))
        message = chat_completion(ResponseHeader.new("c", "llm"), result, sent.reply()).model_dump()["choices"][0]
        assert message["finish_reason"] == "tool_calls" and message["message"]["reasoning"] == "Need the weather tool."
        (call,) = message["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
        replies, streamed = StreamedReplies(sent.reply()), []
        size = pieces or len(HARMONY_CALL)
        parts = [HARMONY_CALL[at:at + size] for at in range(0, len(HARMONY_CALL), size)]
        for index, part in enumerate(parts):
            delta, reason = replies.delta(0, step(part, "stop" if index == len(parts) - 1 else None).samples[0])
            streamed.append((delta, reason))
        calls = [c for delta, _ in streamed for c in delta.tool_calls or []]
        assert [c.function.name for c in calls] == ["get_weather"] and streamed[-1][1] == "tool_calls"
        assert "".join(d.reasoning or "" for d, _ in streamed) == "Need the weather tool."
        assert not "".join(d.content or "" for d, _ in streamed)


def test_harmony_variants_and_what_is_not_a_call():
    """The recipient before the channel (`<|start|>assistant to=functions.X<|channel|>...`), a
    commentary preamble (answer), a call of an unlisted tool or with broken JSON (answer), and
    text that is not Harmony at all (answer)."""
    sent = chat_request(request(tools=TOOLS), 64, reasoning_parser="openai_gptoss")

    def read(text: str) -> dict:
        result = Accumulator()
        result.add(step(text, "stop"))
        return chat_completion(ResponseHeader.new("c", "llm"), result, sent.reply()).model_dump()["choices"][0]["message"]

    before = read('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather'
                  '<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>')
    assert before["content"] == "Checking." and before["tool_calls"][0]["function"]["name"] == "get_weather"
    assert read('<|channel|>commentary to=functions.get_time<|message|>{}<|call|>')["content"] == "{}"
    assert read('<|channel|>commentary to=functions.get_weather<|message|>{"city": <|call|>')["content"] == '{"city": '
    assert read("plain words")["content"] == "plain words"
    cut = read("<|channel|>analysis<|message|>Thinking.<|end|><|start|>assistant<|channel|>fin")  # max_tokens mid-header
    assert cut["content"] == "" and cut["reasoning"] == "Thinking."


def test_grammar_forced_text_is_not_read_for_reasoning():
    """tool_choice required, response_format, vLLM's grammar fields: the grammar makes the whole
    text the JSON from its first token (no room to think), which stays the answer."""
    for fields in ({"tools": TOOLS, "tool_choice": "required"}, {"response_format": {"type": "json_object"}},
                   {"guided_regex": "[0-9]+"}):
        sent = chat_request(request(**fields), 64, reasoning_parser="qwen3")
        assert sent.reasoning is None, fields
    whole, _ = served('{"a": 1}', "deepseek_r1", response_format={"type": "json_object"})
    assert whole["message"]["content"] == '{"a": 1}' and "reasoning" not in whole["message"]


def test_bad_fields_and_settings_are_named():
    with pytest.raises(OpenAIError, match="skip_special_tokens") as harmony:  # it would strip Harmony's markers
        chat_request(request(skip_special_tokens=True), 64, reasoning_parser="openai_gptoss")
    assert harmony.value.param == "skip_special_tokens"
    with pytest.raises(OpenAIError, match="chat_template_kwargs"):
        chat_request(request(chat_template_kwargs=["enable_thinking"]), 64)
    with pytest.raises(OpenAIError, match="include_reasoning"):
        chat_request(request(include_reasoning="no"), 64, reasoning_parser="qwen3")
    with pytest.raises(GatewayConfigError, match="--reasoning-parser"):
        GatewayConfig(reasoning_parser="r1")
    assert GatewayConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
