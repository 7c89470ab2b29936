"""Tool calling in the gateway, without a server: `tools` / `tool_choice` checked and turned
into what `llm` is sent, and model text read back as OpenAI's `tool_calls`, whole and
streamed in pieces split anywhere."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.client.openai_gateway import GatewayConfig, GatewayConfigError
from pagedserve.client.openai_gateway.errors import OpenAIError
from pagedserve.client.openai_gateway.replies import ReplyPlan
from pagedserve.client.openai_gateway.responses import StreamedReplies
from pagedserve.client.openai_gateway.schemas import ChatCompletionRequest
from pagedserve.client.openai_gateway.tool_parsers import Emission, assemble
from pagedserve.client.openai_gateway.tools import tool_plan
from pagedserve.client.openai_gateway.translate import chat_request
from pagedserve.client.openai_gateway.triton_stream import SampleDelta

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def read(plan, text: str, pieces: int | None = None) -> tuple[str | None, list[dict]]:
    """The message a choice's text becomes, fed whole or in `pieces`-character pieces."""
    reader, emission = plan.extractor(), Emission()
    step = pieces or max(len(text), 1)
    for at in range(0, len(text), step):
        emission += reader.feed(text[at:at + step])
    emission += reader.finish()
    return assemble(emission)


def calls_of(message: tuple[str | None, list[dict]]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message[1]]


def request(**fields):
    return ChatCompletionRequest(model="llm", messages=[{"role": "user", "content": "weather?"}], **fields)


def test_tools_go_to_the_chat_template_and_auto_parses_without_a_grammar():
    sent = chat_request(request(tools=TOOLS), 16)
    inputs = sent.inputs()
    assert json.loads(inputs["tools"]) == TOOLS
    sampling = json.loads(inputs["sampling_parameters"])
    assert "structured_outputs" not in sampling and sampling["skip_special_tokens"] is False  # markers are special tokens
    assert sent.tools.choice == "auto"
    hermes = GatewayConfig(tool_call_parser="hermes").tool_call_parser
    assert "skip_special_tokens" not in json.loads(chat_request(request(tools=TOOLS), 16, None, hermes).inputs()["sampling_parameters"])


def test_required_is_a_grammar_over_every_tool_and_its_answers_validate():
    plan = chat_request(request(tools=TOOLS, tool_choice="required"), 16).tools
    schema = json.loads(chat_request(request(tools=TOOLS, tool_choice="required"), 16).inputs()["sampling_parameters"])[
        "structured_outputs"]["json"]
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(chat_request(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), 16)
                        .inputs()["sampling_parameters"])["structured_outputs"]["json"]
    assert single["maxItems"] == 1
    text = json.dumps(good, indent=1)
    for pieces in (None, 1, 3, 7):
        assert calls_of(read(plan, text, pieces)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert read(plan, text)[0] is None
    assert plan.finish_reason("stop", True) == "tool_calls" and plan.finish_reason("length", True) == "length"
    cut = read(plan, '[{"name": "get_weather", "parameters": {"ci')  # max_tokens cut it: the text is shown
    assert cut == ('[{"name": "get_weather", "parameters": {"ci', [])


def test_a_named_function_is_its_arguments_streamed_as_they_come():
    sent = chat_request(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), 16)
    assert json.loads(sent.inputs()["sampling_parameters"])["structured_outputs"] == {"json": WEATHER,
                                                                                      "disable_any_whitespace": True}
    calls = StreamedReplies(ReplyPlan(sent.tools))
    deltas = [calls.delta(0, SampleDelta(piece, reason, 1)) for piece, reason in
              (('{"city": ', None), ('"Oslo"', None), ("}", "stop"))]
    first = deltas[0][0].tool_calls[0]
    assert first.id and first.function.name == "get_weather" and first.type == "function"
    assert all(d.tool_calls[0].id is None and d.tool_calls[0].index == 0 for d, _ in deltas[1:])
    assert "".join(d.tool_calls[0].function.arguments for d, _ in deltas) == '{"city": "Oslo"}'
    assert deltas[-1][1] == "stop"  # OpenAI's finish reason for a forced function


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": "{}"}]'),
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}'),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'),
])
@pytest.mark.parametrize("configured", [False, True])
def test_each_familys_calls_are_read_by_its_parser_and_by_auto(parser, text, configured):
    plan = tool_plan({"tools": TOOLS}, parser if configured else "auto")
    for pieces in (None, 1, 2, 5):
        content, calls = read(plan, text, pieces)
        assert calls_of((content, calls)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
        assert content == ("Let me check." if "Let me" in text else None) or content.strip() == "Let me check."
        assert len({c["id"] for c in calls}) == 2
    single = tool_plan({"tools": TOOLS, "parallel_tool_calls": False}, parser)
    assert [name for name, _ in calls_of(read(single, text))] == ["get_weather"]


def test_plain_answers_and_broken_calls_stay_content_and_no_marker_leaks():
    plan = tool_plan({"tools": TOOLS}, "auto")
    for text in ("It is sunny in Oslo.", "Use <b>bold</b> [brackets] {braces}", '{"not": "a call"}',
                 '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>', "<tool_call>{broken"):
        for pieces in (None, 1, 4):
            assert read(plan, text, pieces) == (text.lstrip(), [])
    calls = StreamedReplies(ReplyPlan(plan))
    shown = [calls.delta(0, SampleDelta(piece, None, 1))[0].content for piece in ("Sure <", "tool_", "call>{")]
    assert shown == ["Sure ", None, None]  # what may be a marker is held back, never shown half


def test_tool_choice_none_reads_nothing():
    plan = tool_plan({"tools": TOOLS, "tool_choice": "none"})
    assert not plan.parses and plan.grammar() is None
    assert json.loads(chat_request(request(tools=TOOLS, tool_choice="none"), 16).inputs()["tools"]) == TOOLS


def test_a_conversation_with_calls_and_their_results_reaches_the_template():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    sent = chat_request(ChatCompletionRequest(model="llm", messages=messages, tools=TOOLS), 16)
    assert sent.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert sent.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("fields, param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_tool_fields_are_a_400_naming_the_field(fields, param):
    body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]} | fields
    with pytest.raises(OpenAIError) as refused:
        chat_request(ChatCompletionRequest(**body), 16)
    assert refused.value.status == 400 and refused.value.param == param


def test_the_parser_flag_is_checked():
    with pytest.raises(GatewayConfigError, match="tool_call_parser"):
        GatewayConfig(tool_call_parser="qwen9")
