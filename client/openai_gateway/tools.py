"""Tool calling: OpenAI's `tools` / `tool_choice` checked and planned, and the model's text
turned back into `tool_calls`.

The tools go to `llm` beside the messages, so the served model's own chat template shows
them to the model as it was trained to see them. What comes back depends on `tool_choice`:

- `auto`: the model decides; its text is read by the parser of its family (`hermes`:
  Hermes / Qwen `<tool_call>{...}</tool_call>`; `mistral`: `[TOOL_CALLS]` then a JSON list
  or `name[ARGS]{...}`; `llama3_json`: a JSON object `{"name", "parameters"}`, maybe after
  `<|python_tag|>`; `openai`: gpt-oss's Harmony messages to `functions.NAME`). The gateway's
  `tool_call_parser` picks one; `auto` knows the first three by their own markers, so it needs
  no flag for any of them.
- `required` and a named function: enforced by grammar, not by hope. The model must write
  a JSON list of `{"name", "parameters"}` calls of the listed tools (a named function: its
  arguments object alone), as structured outputs, whatever the model's family.
- `none`: nothing is parsed; the text is the answer.

Streamed, a call goes out as deltas the openai SDK assembles: its id, name and arguments in
the first delta of that call (a named function's arguments as they are generated). Reading
the text is tool_parsers.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import OpenAIError
from .tool_parsers import CallExtractor, ModelFormatCalls, NamedCall, RequiredCalls

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
SPECIAL_MARKER_PARSERS = ("auto", "mistral", "llama3_json", "openai")
"""Parsers whose markers are special tokens: the text must keep them (skip_special_tokens off)."""
CHOICES = 'none, auto, required or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what it asked of them."""

    tools: tuple[dict, ...]
    """The definitions as sent (OpenAI's shape), for the chat template."""
    parameters: dict[str, dict]
    """Function name -> its parameters' JSON schema."""
    choice: str
    """none, auto, required, or function (one named function)."""
    named: str | None = None
    parallel: bool = True
    parser: str = "auto"

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> dict | None:
        """`llm`'s structured outputs that force the call (required, a named function), in
        one compact form: no blank runs for a sampling model to spend max_tokens on."""
        if self.choice == "function":
            assert self.named is not None  # the function choice always names one
            return {"json": self.parameters[self.named], "disable_any_whitespace": True}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.parameters.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array, "disable_any_whitespace": True}

    def keeps_special_tokens(self) -> bool:
        """The model's markers are special tokens the text must keep (auto choice only)."""
        return self.choice == "auto" and self.parser in SPECIAL_MARKER_PARSERS

    def extractor(self) -> CallExtractor:
        """A fresh reader of one choice's text."""
        if self.choice == "function":
            assert self.named is not None  # the function choice always names one
            return NamedCall(self.named)
        if self.choice == "required":
            return RequiredCalls(self.parallel)
        return ModelFormatCalls(self.parser, set(self.parameters), self.parallel)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: `tool_calls` where the model stopped after calling (named: `stop`)."""
        if called and reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason


def tool_plan(fields: dict[str, Any], parser: str = "auto") -> ToolPlan | None:
    """The plan of a chat request's `tools`, `tool_choice` and `parallel_tool_calls`
    (None: no tools); anything malformed is a 400 naming the field."""
    tools = fields.get("tools")
    choice = fields.get("tool_choice")
    parallel = fields.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be true or false")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise _bad("tool_choice", "is only allowed when `tools` are given")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    parameters: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        name, schema = _function(index, tool)
        if name in parameters:
            raise _bad(f"tools[{index}].function.name", f"{name!r} is defined twice")
        parameters[name] = schema
    choice = "auto" if choice is None else choice
    named = None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if not isinstance(named, str):
            raise _bad("tool_choice", f"must be {CHOICES}")
        if named not in parameters:
            raise _bad("tool_choice.function.name", f"{named!r} is not among `tools` ({', '.join(parameters)})")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", f"must be {CHOICES}")
    return ToolPlan(tuple(tools), parameters, choice, named, parallel is not False, parser)


def _function(index: int, tool: Any) -> tuple[str, dict]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(where, "must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_', '-' or '.'")
    schema = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise _bad(f"{where}.function.parameters", "must be a JSON schema of an object")
    return name, schema


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"`{param}`: {message}", param=param)
