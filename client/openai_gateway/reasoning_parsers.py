"""A reasoning model's text read back as OpenAI-style messages: its reasoning apart from its
answer (vLLM's `--reasoning-parser`, whose names these are), as the text streams.

- `deepseek_r1`, `qwen3` (`ThinkTags`): reasoning up to `</think>`, a leading `<think>` dropped
  (DeepSeek-R1's and Qwen3-Thinking's templates open it in the prompt, Qwen3's hybrid models
  write it); the answer after it. Qwen3 with `enable_thinking: false` in the request's
  `chat_template_kwargs` does not think: its text is all answer.
- `openai_gptoss` (`HarmonyMessages`): gpt-oss's Harmony format, whose markers are special
  tokens (the text keeps them): messages `<|channel|>CHANNEL [to=RECIPIENT] ...<|message|>BODY`
  ended by `<|end|>`, `<|call|>` or `<|return|>`, each after the first opened by
  `<|start|>assistant`. The `analysis` channel is reasoning; a message to `functions.NAME` is a
  call of that tool (with `tool_choice: auto`); any other (`final`, a `commentary` preamble)
  is answer.

Text that might still become a marker is held back until it cannot, so no marker leaks.
"""

from __future__ import annotations

import json
import re

from .tool_parsers import CallExtractor, Emission, held_back

REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
"""The gateway's `reasoning_parser` values."""
THINK_START, THINK_END = "<think>", "</think>"
HARMONY_MESSAGE = "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class ThinkTags:
    """`<think>` reasoning `</think>` answer, read as it streams: `feed` and `finish` give
    (reasoning, answer) text."""

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        """Still in the reasoning (False once `</think>` is read, or for a model that does not think)."""
        self.started = False
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        self.held += text
        if not self.started:
            stripped = self.held.lstrip()
            if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):  # maybe the opening tag
                return "", ""
            self.started = True
            if stripped.startswith(THINK_START):
                self.held = stripped[len(THINK_START):]
        end = self.held.find(THINK_END)
        if end >= 0:
            reasoning, answer, self.held, self.thinking = self.held[:end], self.held[end + len(THINK_END):], "", False
            return reasoning, answer
        keep = held_back(self.held, (THINK_END,))
        reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What is held: reasoning cut short (max_tokens) stays reasoning."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", held)


class HarmonyMessages(CallExtractor):
    """gpt-oss's Harmony messages: reasoning, answer and tool calls (of the tools in `names`;
    one at most unless `parallel`). A call goes out whole when its message ends; one that names
    no listed tool or whose arguments are not JSON is given back as answer."""

    def __init__(self, names: set[str], parallel: bool = True):
        self.names, self.parallel = names, parallel
        self.held = ""
        self.kind: str | None = None
        """The message being read: reasoning, answer or call; None while reading a header."""
        self.function = ""
        self.arguments = ""

    def feed(self, text: str) -> Emission:
        self.held += text
        out = Emission()
        while self.held:
            if self.kind is None:
                at = self.held.find(HARMONY_MESSAGE)
                if at < 0:
                    break
                self._open(self.held[:at])
                self.held = self.held[at + len(HARMONY_MESSAGE):]
                continue
            ends = [(self.held.find(marker), marker) for marker in HARMONY_ENDS if marker in self.held]
            if ends:
                at, marker = min(ends)
                out += self._body(self.held[:at])
                out += self._close()
                self.held = self.held[at + len(marker):]
                continue
            keep = held_back(self.held, HARMONY_ENDS)
            out += self._body(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            break
        return out

    def _open(self, header: str) -> None:
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self.kind, self.function, self.arguments = "call", recipient.group(1)[len("functions."):], ""
        else:
            self.kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "answer"

    def _body(self, text: str) -> Emission:
        if self.kind == "call":
            self.arguments += text
            return Emission()
        return Emission(reasoning=text) if self.kind == "reasoning" else Emission(content=text)

    def _close(self) -> Emission:
        kind, self.kind = self.kind, None
        if kind != "call":
            return Emission()
        arguments = self.arguments.strip()
        try:
            json.loads(arguments)
        except ValueError:
            return Emission(content=self.arguments)
        if self.function not in self.names or (self.called and not self.parallel):
            return Emission(content=self.arguments)
        return Emission(calls=[self._call(self.function, arguments)])

    def finish(self) -> Emission:
        """A message cut short (max_tokens) ends here; a header cut short is dropped; text outside
        any message before a marker (a model that does not write Harmony) is answer."""
        held, self.held = self.held, ""
        if self.kind is None:
            text = held.split("<|", 1)[0]
            return Emission(content=text) if text.strip() else Emission()
        out = self._body(held)
        out += self._close()
        return out


__all__ = ["HarmonyMessages", "REASONING_PARSERS", "ThinkTags"]
