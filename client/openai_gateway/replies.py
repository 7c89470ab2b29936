"""How a chat choice's text becomes an assistant message: plain content, or read for tool calls
(tools.py, tool_parsers.py) and reasoning (reasoning_parsers.py), whole or as it streams."""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning_parsers import HarmonyMessages, ThinkTags
from .tool_parsers import CallExtractor, Emission
from .tools import ToolPlan

HARMONY = "openai_gptoss"


@dataclass(frozen=True)
class ReplyPlan:
    """A chat request's tools and reasoning parser (None: the model's text is its answer)."""

    tools: ToolPlan | None = None
    reasoning: str | None = None
    """The gateway's reasoning parser where this request's text is read with it."""
    include_reasoning: bool = True
    """vLLM's `include_reasoning`: false drops the reasoning (it is still told apart from the answer)."""

    @property
    def reads(self) -> bool:
        return self.reasoning is not None or (self.tools is not None and self.tools.parses)

    @property
    def harmony(self) -> bool:
        """gpt-oss's Harmony messages: its reasoning parser, or its tool-call parser (`openai`) where
        the model chooses its calls."""
        return self.reasoning == HARMONY or (self.tools is not None and self.tools.choice == "auto"
                                             and self.tools.parser == "openai")

    def reader(self) -> MessageReader:
        """A fresh reader of one choice's text."""
        if self.harmony:  # the messages carry the calls too (never under a grammar: see reasoning_for)
            auto = self.tools is not None and self.tools.choice == "auto"
            names = set(self.tools.parameters) if self.tools is not None and auto else set()
            return MessageReader(None, HarmonyMessages(names, self.tools.parallel if self.tools is not None else True))
        calls = self.tools.extractor() if self.tools is not None and self.tools.parses else None
        return MessageReader(None if self.reasoning is None else ThinkTags(), calls)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return reason if self.tools is None else self.tools.finish_reason(reason, called)


def reasoning_for(parser: str | None, template_kwargs: dict, constrained: bool) -> str | None:
    """The reasoning parser a chat's text is read with: none where the request turned thinking off
    (Qwen3's `enable_thinking: false`), or where a grammar forces the whole text (`constrained`:
    `response_format`, vLLM's grammar fields, `tool_choice` required or a named function: the model
    writes the JSON from its first token, with no room to think first)."""
    if parser is None or constrained:
        return None
    if parser == "qwen3" and template_kwargs.get("enable_thinking") is False:
        return None
    return parser


class MessageReader:
    """One choice's text as it arrives: `feed` each piece, `finish` at its end; each gives what
    the text adds to the message."""

    def __init__(self, think: ThinkTags | None, calls: CallExtractor | None):
        self.think, self.calls = think, calls

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, text: str) -> Emission:
        reasoning, answer = self.think.feed(text) if self.think is not None else ("", text)
        return self._answer(reasoning, answer)

    def finish(self) -> Emission:
        reasoning, answer = self.think.finish() if self.think is not None else ("", "")
        out = self._answer(reasoning, answer)
        if self.calls is not None:
            out += self.calls.finish()
        return out

    def _answer(self, reasoning: str, answer: str) -> Emission:
        out = self.calls.feed(answer) if self.calls is not None else Emission(content=answer)
        out.reasoning = reasoning + out.reasoning
        return out


__all__ = ["MessageReader", "ReplyPlan", "reasoning_for"]
