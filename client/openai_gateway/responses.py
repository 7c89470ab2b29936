"""OpenAI response bodies built from the `llm` model's responses.

Usage is counted by the server (`num_input_tokens` once per prompt, `num_output_tokens`
per response and sample), so it is exact without a tokenizer in the gateway.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from . import schemas
from .replies import MessageReader, ReplyPlan
from .tool_parsers import Emission, assemble
from .triton_stream import LLMStep, SampleDelta, TokenLogprob

try:
    SYSTEM_FINGERPRINT = f"pagedserve-{version('pagedserve')}"
except PackageNotFoundError:  # run from a source tree without installing
    SYSTEM_FINGERPRINT = "pagedserve"


@dataclass
class ResponseHeader:
    """id, created and model: the same on a response and on every chunk of it."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseHeader":
        return cls(f"{prefix}-{uuid.uuid4().hex}", model)

    def fields(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT}


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.finish_reason = delta.finish_reason or self.finish_reason
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs


@dataclass
class Accumulator:
    """Choices (index = prompt index * n + sample index) and token counts of one request."""

    n: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    choices: dict[int, Choice] = field(default_factory=dict)
    _prompts_counted: set[int] = field(default_factory=set)

    def add(self, step: LLMStep, prompt_index: int = 0) -> None:
        self.count_prompt(step, prompt_index)
        for i, delta in enumerate(step.samples):
            self.completion_tokens += delta.num_tokens
            self.choices.setdefault(prompt_index * self.n + i, Choice()).add(delta)

    def count_prompt(self, step: LLMStep, prompt_index: int = 0) -> None:
        """Count a prompt's tokens once, from the first of its steps that carries them."""
        if prompt_index not in self._prompts_counted and step.num_input_tokens:
            self.prompt_tokens += step.num_input_tokens
            self._prompts_counted.add(prompt_index)

    def usage(self) -> schemas.Usage:
        return schemas.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


# -- logprobs -------------------------------------------------------------------------
def chat_logprobs(tokens: list[TokenLogprob] | None) -> schemas.ChatLogprobs | None:
    if tokens is None:
        return None
    return schemas.ChatLogprobs(content=[
        schemas.TokenLogprob(
            token=t.token, logprob=t.logprob, bytes=list(t.token.encode("utf-8")),
            top_logprobs=[schemas.TopLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8"))) for s, lp in t.top],
        )
        for t in tokens
    ])


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> schemas.CompletionLogprobs | None:
    """`offset`: where the first token starts in the choice's text (after an echoed prompt)."""
    if tokens is None:
        return None
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return schemas.CompletionLogprobs(
        tokens=[t.token for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{s: lp for s, lp in t.top} for t in tokens],
        text_offset=offsets,
    )


# -- whole responses ------------------------------------------------------------------
def chat_completion(header: ResponseHeader, result: Accumulator, plan: ReplyPlan | None = None) -> schemas.ChatCompletion:
    """`plan`: how each choice's text is read for tool calls and reasoning (None: it is the answer)."""
    choices = []
    for i, c in sorted(result.choices.items()):
        message, reason = schemas.AssistantMessage(content=c.text), c.finish_reason
        if plan is not None:
            reader = plan.reader()
            emission = reader.feed(c.text)
            emission += reader.finish()
            content, calls = assemble(emission)
            reasoning = _reasoning(plan, emission)
            message = schemas.AssistantMessage(content=content, tool_calls=[schemas.ToolCall(**call) for call in calls] or None,
                                               reasoning=reasoning, reasoning_content=reasoning)
            reason = plan.finish_reason(c.finish_reason, reader.called)
        choices.append(schemas.ChatChoice(index=i, message=message, finish_reason=reason, logprobs=chat_logprobs(c.logprobs)))
    return schemas.ChatCompletion(**header.fields(), choices=choices, usage=result.usage())


def _reasoning(plan: ReplyPlan, emission: Emission) -> str | None:
    """A message's (or delta's) reasoning, where there is some to show (under both its names)."""
    return emission.reasoning if plan.include_reasoning and emission.reasoning else None


def completion(header: ResponseHeader, result: Accumulator, prompts: list[str], echo: bool) -> schemas.Completion:
    choices = []
    for i, c in sorted(result.choices.items()):
        prompt_length = len(prompts[i // result.n]) if echo else 0
        choices.append(schemas.CompletionChoice(
            index=i, text=c.text, finish_reason=c.finish_reason,
            logprobs=completion_logprobs(c.logprobs, prompt_length),
        ))
    return schemas.Completion(**header.fields(), choices=choices, usage=result.usage())


# -- streamed chunks ------------------------------------------------------------------
def chat_role_chunk(header: ResponseHeader, n: int) -> schemas.ChatCompletionChunk:
    """The first chunk: the assistant role for every choice, as OpenAI sends it."""
    choices = [schemas.ChatChunkChoice(index=i, delta=schemas.ChatDelta(role="assistant", content="")) for i in range(n)]
    return schemas.ChatCompletionChunk(**header.fields(), choices=choices)


def chat_chunks(header: ResponseHeader, step: LLMStep,
                replies: StreamedReplies | None = None) -> list[schemas.ChatCompletionChunk]:
    """One chunk per choice that this response moved on (`replies`: the choices' text read for
    tool calls and reasoning; a choice whose text is held back, maybe a marker's start, moves on
    later)."""
    chunks = []
    for i, d in moved(step):
        delta, reason = schemas.ChatDelta(content=d.text), d.finish_reason
        if replies is not None:
            delta, reason = replies.delta(i, d)
            if not (delta.content or delta.tool_calls or delta.reasoning or reason or d.logprobs):
                continue
        chunks.append(schemas.ChatCompletionChunk(**header.fields(), choices=[schemas.ChatChunkChoice(
            index=i, delta=delta, finish_reason=reason, logprobs=chat_logprobs(d.logprobs))]))
    return chunks


class StreamedReplies:
    """A streamed chat's choices read as messages: one reader per choice, its deltas as OpenAI's."""

    def __init__(self, plan: ReplyPlan):
        self.plan = plan
        self.readers: dict[int, MessageReader] = {}

    def delta(self, index: int, sample: SampleDelta) -> tuple[schemas.ChatDelta, str | None]:
        reader = self.readers.setdefault(index, self.plan.reader())
        emission: Emission = reader.feed(sample.text)
        if sample.finish_reason:
            emission += reader.finish()
        calls = [schemas.DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                       function=schemas.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for c in emission.calls]
        reasoning = _reasoning(self.plan, emission)
        delta = schemas.ChatDelta(content=emission.content or None, tool_calls=calls or None, reasoning=reasoning,
                                  reasoning_content=reasoning)
        return delta, self.plan.finish_reason(sample.finish_reason, reader.called)


def completion_chunks(header: ResponseHeader, step: LLMStep, first_index: int) -> list[schemas.Completion]:
    return [
        schemas.Completion(**header.fields(), choices=[schemas.CompletionChoice(
            index=first_index + i, text=d.text, finish_reason=d.finish_reason,
            logprobs=completion_logprobs(d.logprobs),
        )])
        for i, d in moved(step)
    ]


def moved(step: LLMStep) -> list[tuple[int, SampleDelta]]:
    """(sample index, delta) of the samples this response moved on (text, an end, logprobs)."""
    return [(i, d) for i, d in enumerate(step.samples) if d.text or d.finish_reason or d.logprobs]


def usage_chunk(header: ResponseHeader, result: Accumulator, chat: bool) -> schemas.BaseModel:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    kind = schemas.ChatCompletionChunk if chat else schemas.Completion
    return kind(**header.fields(), choices=[], usage=result.usage())
