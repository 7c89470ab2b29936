"""Tool calls read back out of a choice's text, as it streams: the pieces of OpenAI's
`tool_calls` (DeltaCall) and the content around them (Emission), one reader per choice.

- NamedCall: a named function's arguments (the text itself, grammar-enforced).
- RequiredCalls: a JSON list of {"name", "parameters"} (grammar-enforced), a call per object.
- ModelFormatCalls: `tool_choice: auto`, a model family's own format (`hermes`: Hermes /
  Qwen `<tool_call>{...}</tool_call>`; `mistral`: `[TOOL_CALLS]` then a JSON list or
  `name[ARGS]{...}`; `llama3_json`: `{"name", "parameters"}`, maybe after `<|python_tag|>`),
  or any of them by its markers (`auto`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("auto", "hermes", "mistral", "llama3_json", "openai")
"""The gateway's `tool_call_parser` values (openai: gpt-oss's Harmony messages, reasoning_parsers.py's)."""
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
HERMES_END = "</tool_call>"


@dataclass(frozen=True)
class DeltaCall:
    """A piece of one tool call: the first piece of a call carries its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Emission:
    """What a choice's text adds to its message: content, pieces of tool calls, and reasoning
    (reasoning_parsers.py's)."""

    content: str = ""
    calls: list[DeltaCall] = field(default_factory=list)
    reasoning: str = ""

    def __iadd__(self, other: Emission) -> Emission:
        self.content += other.content
        self.calls += other.calls
        self.reasoning += other.reasoning
        return self


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallExtractor:
    """Reads one choice's text as it arrives: `feed` each piece, `finish` at its end."""

    count = 0
    """Calls given out so far."""

    @property
    def called(self) -> bool:
        return self.count > 0

    def feed(self, text: str) -> Emission:
        raise NotImplementedError

    def finish(self) -> Emission:
        raise NotImplementedError

    def _call(self, name: str, arguments: Any) -> DeltaCall:
        """A call's first piece (a whole call, but for a named function's arguments), numbered in order."""
        self.count += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return DeltaCall(self.count - 1, text, new_call_id(), name)


class NamedCall(CallExtractor):
    """tool_choice names the function: the text is its arguments (grammar-enforced),
    streamed as they come."""

    def __init__(self, name: str):
        self.name = name

    def feed(self, text: str) -> Emission:
        if not self.called:
            return Emission(calls=[self._call(self.name, text)])
        return Emission(calls=[DeltaCall(0, text)] if text else [])

    def finish(self) -> Emission:
        return self.feed("") if not self.called else Emission()


class RequiredCalls(CallExtractor):
    """tool_choice required: the text is a JSON list of {"name", "parameters"} (grammar-
    enforced); each call goes out when its object closes."""

    def __init__(self, parallel: bool):
        self.parallel = parallel
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.start = -1

    def feed(self, text: str) -> Emission:
        scanned, self.text = len(self.text), self.text + text
        out = Emission()
        for position in range(scanned, len(self.text)):
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
        keep = held_back(self.held, tuple(MARKERS[p] for p in self.parsers))
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


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of `markers` (to be held back)."""
    return max((k for marker in markers for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


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
