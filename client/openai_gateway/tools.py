"""Tool calling: OpenAI's `tools` / `tool_choice` checked and planned, and the model's text
turned back into `tool_calls`.

The tools go to `llm` beside the messages, so the served model's own chat template shows
them to the model as it was trained to see them. What comes back depends on `tool_choice`:

- `auto`: the model decides; its text is read by the parser of its family (`hermes`:
  Hermes / Qwen `<tool_call>{...}</tool_call>`; `mistral`: `[TOOL_CALLS]` then a JSON list
  or `name[ARGS]{...}`; `llama3_json`: a JSON object `{"name", "parameters"}`, maybe after
  `<|python_tag|>`). The gateway's `tool_call_parser` picks one; `auto` knows each family by
  its own markers, so it needs no flag for any of them.
- `required` and a named function: enforced by grammar, not by hope. The model must write
  a JSON list of `{"name", "parameters"}` calls of the listed tools (a named function: its
  arguments object alone), as structured outputs, whatever the model's family.
- `none`: nothing is parsed; the text is the answer.

Streamed, a call goes out as deltas the openai SDK assembles: its id, name and arguments in
the first delta of that call (a named function's arguments as they are generated).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import OpenAIError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PARSERS = ("auto", "hermes", "mistral", "llama3_json")
"""The gateway's `tool_call_parser` values."""
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
HERMES_END = "</tool_call>"
SPECIAL_MARKER_PARSERS = ("auto", "mistral", "llama3_json")
"""Parsers whose markers are special tokens: the text must keep them (skip_special_tokens off)."""


@dataclass(frozen=True)
class DeltaCall:
    """A piece of one tool call: the first piece of a call carries its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Emission:
    """What a choice's text adds to its message: content, and pieces of tool calls."""

    content: str = ""
    calls: list[DeltaCall] = field(default_factory=list)

    def __iadd__(self, other: Emission) -> Emission:
        self.content += other.content
        self.calls += other.calls
        return self


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
            raise _bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if named not in parameters:
            raise _bad("tool_choice.function.name", f"{named!r} is not among `tools` ({', '.join(parameters)})")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- reading a choice's text ------------------------------------------------------------
class CallExtractor:
    """Reads one choice's text as it arrives: `feed` each piece, `finish` at its end."""

    called = False
    count = 0
    """Whole calls given out so far."""

    def feed(self, text: str) -> Emission:
        raise NotImplementedError

    def finish(self) -> Emission:
        raise NotImplementedError

    def _call(self, name: str, arguments: Any) -> DeltaCall:
        """A whole call, numbered in order."""
        self.called, self.count = True, self.count + 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return DeltaCall(self.count - 1, text, new_call_id(), name)


class NamedCall(CallExtractor):
    """tool_choice names the function: the text is its arguments (grammar-enforced),
    streamed as they come."""

    def __init__(self, name: str):
        self.name = name

    def feed(self, text: str) -> Emission:
        if not self.called:
            self.called = True
            return Emission(calls=[DeltaCall(0, text, new_call_id(), self.name)])
        return Emission(calls=[DeltaCall(0, text)] if text else [])

    def finish(self) -> Emission:
        return self.feed("") if not self.called else Emission()


class RequiredCalls(CallExtractor):
    """tool_choice required: the text is a JSON list of {"name", "parameters"} (grammar-
    enforced); each call goes out when its object closes."""

    def __init__(self, parallel: bool):
        self.parallel = parallel
        self.text = ""
        self.scanned = 0
        self.depth = 0
        self.in_string = self.escaped = False
        self.start = -1

    def feed(self, text: str) -> Emission:
        self.text += text
        out = Emission()
        for position in range(self.scanned, len(self.text)):
            char = self.text[position]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
                continue
            if char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = position
            elif char in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start >= 0:
                    out.calls += self._element(self.text[self.start:position + 1])
                    self.start = -1
        self.scanned = len(self.text)
        return out

    def _element(self, text: str) -> list[DeltaCall]:
        try:
            call = json.loads(text)
            name, arguments = call["name"], call["parameters"]
        except (ValueError, KeyError, TypeError):
            return []
        if self.called and not self.parallel:
            return []
        return [self._call(name, arguments)]

    def finish(self) -> Emission:
        # cut short (max_tokens) before any call was whole: the text is all there is to show
        return Emission() if self.called else Emission(content=self.text)


class ModelFormatCalls(CallExtractor):
    """tool_choice auto: content until a family's marker, then calls in that family's
    format. Text that might still become a marker is held back, so no marker leaks into
    the content; a call that does not parse (or names no listed tool) is given back as
    content."""

    def __init__(self, parser: str, names: set[str], parallel: bool):
        self.parsers = list(MARKERS) if parser == "auto" else [parser]
        self.names = names
        self.parallel = parallel
        self.held = ""  # text not yet given out
        self.family: str | None = None  # the family whose calls are being read
        self.started = False  # any non-space text seen

    def feed(self, text: str) -> Emission:
        self.held += text
        out = Emission()
        while self.held:
            if self.family is None:
                if not self._read_content(out):
                    break
            elif self.family == "hermes":
                end = self.held.find(HERMES_END)
                if end < 0:
                    break
                out += self._parsed("hermes", self.held[:end], MARKERS["hermes"] + self.held[:end] + HERMES_END)
                self.held = self.held[end + len(HERMES_END):].lstrip() if self.called else self.held[end + len(HERMES_END):]
                self.family = None
            else:
                break  # mistral and llama3 calls run to the end of the text
        return out

    def _read_content(self, out: Emission) -> bool:
        """Give out content up to a marker (then switch to its family); False: wait for more."""
        if not self.started:
            stripped = self.held.lstrip()
            if not stripped:
                return False
            self.started = True
            if "llama3_json" in self.parsers and stripped.startswith("{"):
                self.family, self.held = "llama3_json", stripped
                return False
        found = [(self.held.find(MARKERS[p]), p) for p in self.parsers if MARKERS[p] in self.held]
        if found:
            at, family = min(found)
            out.content += self.held[:at]
            self.held, self.family = self.held[at + len(MARKERS[family]):], family
            return True
        keep = max((k for p in self.parsers for k in range(1, len(MARKERS[p])) if self.held.endswith(MARKERS[p][:k])),
                   default=0)
        out.content += self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return False

    def finish(self) -> Emission:
        out, held, self.held = Emission(), self.held, ""
        if self.family == "hermes":  # never closed
            out += self._parsed("hermes", held, MARKERS["hermes"] + held)
        elif self.family is not None:
            out += self._parsed(self.family, held, held if self.family == "llama3_json" else MARKERS[self.family] + held)
        else:
            out.content += held
        return out

    def _parsed(self, family: str, body: str, raw: str) -> Emission:
        """The calls in `body` (a family's format), or `raw` as content where it holds none."""
        calls = _calls(family, body.strip())
        if not calls or any(name not in self.names for name, _ in calls):
            return Emission(content=raw)
        if not self.parallel:
            calls = calls[:0] if self.called else calls[:1]
        return Emission(calls=[self._call(name, arguments) for name, arguments in calls])


def _calls(family: str, body: str) -> list[tuple[str, Any]]:
    """(name, arguments) of each call in a family's format; [] where it does not parse."""
    try:
        if family == "hermes":
            return [_named(json.loads(body), "arguments")]
        if family == "mistral":
            if body.startswith("["):
                return [_named(call, "arguments") for call in json.loads(body)]
            calls = []  # newer templates: name[ARGS]{...}, repeated
            for piece in body.split("[TOOL_CALLS]"):
                name, marker, arguments = piece.partition("[ARGS]")
                if not marker:
                    return []
                calls.append((name.strip(), json.loads(arguments)))
            return calls
        if family == "llama3_json":
            decoder, calls, at = json.JSONDecoder(), [], 0
            while at < len(body):  # objects separated by ';'
                value, at = decoder.raw_decode(body, at)
                calls.append(_named(value, "parameters"))
                at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
            return calls
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
    return []


def _named(call: Any, key: str) -> tuple[str, Any]:
    """(name, arguments) of {"name", key} (either key name accepted)."""
    arguments = call.get(key, call.get("arguments" if key == "parameters" else "parameters"))
    if not isinstance(call["name"], str) or not isinstance(arguments, (dict, str)):
        raise TypeError
    return call["name"], arguments if isinstance(arguments, dict) else json.loads(arguments)


def assemble(emission: Emission) -> tuple[str | None, list[dict]]:
    """A whole message from all of a choice's emissions: content (None where there is only
    calls) and OpenAI's tool_calls."""
    calls: dict[int, dict] = {}
    for piece in emission.calls:
        call = calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                              "function": {"name": piece.name, "arguments": ""}})
        call["function"]["arguments"] += piece.arguments
    content = emission.content if emission.content.strip() or not calls else None
    return content, [calls[i] for i in sorted(calls)]
