"""Chats rendered by the model's template: tool definitions and past calls reach it; what
the template refuses is a named error."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from pagedserve.backend.errors import InvalidRequestError
from pagedserve.backend.tokenizer import apply_chat_template
from pagedserve.backend.triton_adapter.requests import parse_prompt

# a template of the Hermes / Qwen kind, cut down: tools in the system turn, calls in tags
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>\n{% endfor %}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.fixture()
def tool_tokenizer(tokenizer):
    templated = copy.copy(tokenizer)
    templated.chat_template = TOOL_TEMPLATE
    return templated


def test_tools_and_past_calls_reach_the_template(tool_tokenizer):
    ids = apply_chat_template(tool_tokenizer, CHAT, tools=TOOLS)
    assert tool_tokenizer.decode(ids) == (
        '<tools>get_weather;</tools>\nuser: weather?\n<tool_call>get_weather {"city": "Oslo"}</tool_call>\n'
        "<tool_response>sunny</tool_response>\nassistant:")
    inputs = {"messages": np.array([json.dumps(CHAT).encode()], dtype=object),
              "tools": np.array([json.dumps(TOOLS).encode()], dtype=object)}
    assert parse_prompt(inputs, tool_tokenizer) == ids  # `llm`'s messages + tools inputs


@pytest.mark.parametrize("messages, tools, field", [
    (CHAT, {"get_weather": {}}, "tools"),
    ([{"role": "assistant", "content": "", "tool_calls": "get_weather"}], None, "messages[0].tool_calls"),
    ([{"role": "user"}], None, "messages[0]"),
])
def test_malformed_chats_are_named(tool_tokenizer, messages, tools, field):
    with pytest.raises(InvalidRequestError) as refused:
        apply_chat_template(tool_tokenizer, messages, tools=tools)
    assert refused.value.field == field


def test_what_the_template_refuses_is_an_invalid_request(tool_tokenizer):
    tool_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        apply_chat_template(tool_tokenizer, CHAT)
    inputs = {"messages": np.array([json.dumps(CHAT).encode()], dtype=object), "tools": np.array([b"[{"], dtype=object)}
    with pytest.raises(InvalidRequestError, match="tools"):
        parse_prompt(inputs, tool_tokenizer)


def test_chat_template_kwargs_are_the_templates_own_variables(tool_tokenizer):
    """`chat_template_kwargs` (Qwen3's enable_thinking, gpt-oss's reasoning_effort) reach the
    template as its variables, through `llm`'s input of that name; what the server sets itself (a
    template of the client's own above all), or anything but an object, is refused by name."""
    tool_tokenizer.chat_template = ("{{ messages[0].content }}{% if enable_thinking is false %}<think></think>"
                                    "{% endif %}|{{ reasoning_effort | default('medium') }}")
    chat = [{"role": "user", "content": "hi"}]
    assert tool_tokenizer.decode(apply_chat_template(tool_tokenizer, chat)) == "hi|medium"
    inputs = {"messages": np.array([json.dumps(chat).encode()], dtype=object),
              "chat_template_kwargs": np.array([b'{"enable_thinking": false, "reasoning_effort": "low"}'], dtype=object)}
    assert tool_tokenizer.decode(parse_prompt(inputs, tool_tokenizer)) == "hi<think></think>|low"
    for bad, message in (([1], "JSON object"), ({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"tools": []}, "tools"), ({"chat_template": "{{ 7 * 7 }}"}, "chat_template")):
        with pytest.raises(InvalidRequestError, match=message) as refused:
            apply_chat_template(tool_tokenizer, chat, template_kwargs=bad)
        assert refused.value.field == "chat_template_kwargs"
