"""OpenAI request and response bodies (pydantic), as the `openai` SDK sends and reads them.

Requests keep unknown fields (`extra="allow"`) so that a parameter we do not serve can
be refused by name (see translate.py) instead of silently ignored.

Every numeric field a request may carry is range-checked here, once, so that what
reaches Triton is what the engine can honour (backend/sampling_params.py's ranges;
temperature keeps OpenAI's [0, 2]); a value out of range is a 400 naming the field.
NaN and infinities are refused everywhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

INT32 = 2**31
"""Token ids and token counts are below this (what the engine's int32 tensors hold)."""
SEED_LIMIT = 2**63
"""Seeds are in [0, 2^63), the engine's range (a 64-bit generator seed)."""
MAX_LOGPROBS = 20
"""Alternatives per token: OpenAI's and the engine's most."""
MAX_N = 128
"""OpenAI's most `n`; the gateway's `max_choices_per_request` and the model's own cap apply too."""

TokenId = Annotated[int, Field(ge=0, lt=INT32)]
REQUEST_CONFIG = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every streamed chunk carries the usage so far."""


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class SamplingFields(BaseModel):
    """What chat and completions requests share (OpenAI's fields, then vLLM's extensions)."""

    model_config = REQUEST_CONFIG
    model: str
    max_tokens: Optional[int] = Field(None, ge=1, lt=INT32)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, lt=SEED_LIMIT)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extensions that OpenAI-speaking tools send to vLLM servers
    top_k: Optional[int] = Field(None, ge=-1, lt=INT32)
    """-1 or 0: off."""
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    min_tokens: Optional[int] = Field(None, ge=0, lt=INT32)
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    stream_interval: Optional[int] = Field(None, ge=1, lt=INT32)
    """vLLM's: tokens gathered into each streamed chunk (the server's `stream_interval` is the least)."""

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, lt=INT32)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# -- logprobs --------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []


# -- responses -------------------------------------------------------------------------
class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class OmitsNone(BaseModel):
    """Serialized without its unset (None) fields: the SDK merges streamed pieces key by
    key, so a null would overwrite what an earlier piece set."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: Any) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(OmitsNone):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(OmitsNone):
    """A piece of a streamed tool call; the SDK joins the pieces of one `index`."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class Reasoning(BaseModel):
    """A message's reasoning (the gateway's reasoning parser read it), absent where there is none."""

    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    """The same text by vLLM's former name, which many clients still read."""

    @model_serializer(mode="wrap")
    def _without_absent_reasoning(self, handler: Any) -> Any:
        data = handler(self)
        for key in ("reasoning", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class AssistantMessage(Reasoning):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None


class ResponseFields(BaseModel):
    """What every response and chunk carries (see responses.ResponseHeader)."""

    id: str
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    usage: Optional[Usage] = None


class ChatCompletion(ResponseFields):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(Reasoning):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(ResponseFields):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[CompletionLogprobs] = None


class Completion(ResponseFields):
    """Also each streamed chunk of /v1/completions (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    input_modalities: Optional[list[str]] = None
    """What a request may send it: ["text"], or ["text", "image"] for a vision-language model; absent
    where the gateway cannot read the model's config.json."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Any] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
