"""OpenAI requests as `llm` model requests: which inputs to send, which fields to refuse.

The `llm` model speaks Triton's vLLM-backend contract (text or chat `messages` in,
`sampling_parameters` JSON, return_* flags), so most OpenAI fields map one to one onto
vLLM sampling parameters. The chat template is applied in the server, by the served
model's own tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..client import USE_MODEL_DEFAULTS
from .config import GatewayConfig, knob
from .errors import OpenAIError, unsupported
from .images import Image, image_of_part, resolve
from .replies import ReplyPlan, reasoning_for
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from .tools import ToolPlan, tool_plan

# Sent as-is in `sampling_parameters` when not None (OpenAI's names are vLLM's).
_PASSED_THROUGH = (
    "temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "stream_interval",
)

# Fields we cannot honour yet, and the values of them that ask for nothing.
_REFUSED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
}
_GRAMMAR_KEYS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_decoding_backend")
"""vLLM's structured-output fields (an extension OpenAI-speaking tools send to vLLM): passed to
`llm` as they are, where they are checked and refused by name."""


@dataclass
class LLMRequest:
    """One request to the `llm` model: its inputs, and what the gateway must add itself."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    images: list[Image] = field(default_factory=list)
    """The chat's images in order (its image_url parts), base64 once `images.resolve` fetched the URLs."""
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    echo: bool = False
    """The prompt goes in front of the text (completions' `echo`)."""
    top_logprobs: int | None = None
    """How many alternatives per token the client asked for; None: no logprobs."""
    tools: ToolPlan | None = None
    """The chat's tools (sent for the chat template) and how its text becomes tool calls."""
    template_kwargs: dict[str, Any] | None = None
    """The chat's `chat_template_kwargs` (the template's own variables), sent as they are."""
    reasoning: str | None = None
    """The reasoning parser its text is read with (replies.reasoning_for)."""
    include_reasoning: bool = True

    def reply(self) -> ReplyPlan | None:
        """How each choice's text becomes a message (None: the text is the answer)."""
        plan = ReplyPlan(self.tools, self.reasoning, self.include_reasoning)
        return plan if plan.reads else None

    async def fetch_images(self, config: GatewayConfig) -> None:
        """Its images as base64 files, the http(s) ones fetched within the gateway's limits (before
        `inputs`, which sends only those)."""
        if self.images:
            self.images = list(await resolve(self.images, config.allowed_media_domains, config.max_image_bytes,
                                             config.image_fetch_timeout_s))

    def inputs(self) -> dict[str, Any]:
        """Input name -> value (str, bool), for the `llm` model."""
        values: dict[str, Any] = (
            {"messages": json.dumps(self.messages)} if self.messages is not None else {"text_input": self.text}
        )
        if self.tools is not None:
            values["tools"] = json.dumps(self.tools.tools)
        if self.template_kwargs:
            values["chat_template_kwargs"] = json.dumps(self.template_kwargs)
        if self.images:
            values["image"] = [image for image in self.images if isinstance(image, str)]
        values |= {
            "stream": self.stream,
            "exclude_input_in_output": not (self.echo and not self.stream),
            "sampling_parameters": json.dumps(self.sampling),
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
        }
        if self.top_logprobs is not None:
            values["return_logprobs"] = True
        return values


def chat_request(request: ChatCompletionRequest, default_max_tokens: int, max_choices: int | None = None,
                 tool_call_parser: str = "auto", *, model_defaults: bool = False,
                 reasoning_parser: str | None = None) -> LLMRequest:
    """`max_choices`: the gateway's max_choices_per_request (None: no cap); `tool_call_parser`:
    how `tool_choice: auto` reads the model's calls (tools.PARSERS); `model_defaults`: the served
    model's generation_config fills the sampling fields the request leaves out (the gateway's
    generation_config auto); `reasoning_parser`: the gateway's (reasoning_parsers.REASONING_PARSERS)."""
    _refuse_unsupported(request)
    _check_choices(1, request.n, max_choices)
    if request.top_logprobs is not None and not request.logprobs:
        raise unsupported("top_logprobs", "needs `logprobs: true`")
    top = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
    tools = tool_plan(request.model_extra or {}, tool_call_parser)
    sampling = _sampling(request, max_tokens, top, model_defaults)
    if tools is not None and tools.grammar() is not None:
        if any(name in sampling for name in _GRAMMAR_KEYS):
            raise OpenAIError(400, f"`tool_choice` {tools.choice} is enforced by a grammar; `response_format` and "
                                   "vLLM's grammar fields cannot be sent with it", param="tool_choice")
        sampling["structured_outputs"] = tools.grammar()
    extra = request.model_extra or {}
    template_kwargs = extra.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise OpenAIError(400, "`chat_template_kwargs`: must be an object of the chat template's variables",
                          param="chat_template_kwargs")
    include_reasoning = extra.get("include_reasoning", True)
    if not isinstance(include_reasoning, bool):
        raise OpenAIError(400, "`include_reasoning`: must be true or false", param="include_reasoning")
    reasoning = reasoning_for(reasoning_parser, template_kwargs, any(name in sampling for name in _GRAMMAR_KEYS))
    harmony = ReplyPlan(tools, reasoning).harmony
    if harmony and request.skip_special_tokens:
        raise OpenAIError(400, "`skip_special_tokens`: true would drop the Harmony markers gpt-oss's replies are read "
                               "by (the gateway's openai_gptoss / openai parsers); leave it unset",
                          param="skip_special_tokens")
    keeps_markers = harmony or (tools is not None and tools.keeps_special_tokens())
    if keeps_markers and request.skip_special_tokens is None:
        sampling["skip_special_tokens"] = False  # Mistral's, Llama's and Harmony's markers are special tokens
    images: list[Image] = []
    return LLMRequest(
        messages=[_message(i, m, images) for i, m in enumerate(request.messages)],
        images=images,
        sampling=sampling,
        stream=request.stream,
        top_logprobs=top,
        tools=tools,
        template_kwargs=template_kwargs,
        reasoning=reasoning,
        include_reasoning=include_reasoning,
    )


def completion_requests(request: CompletionRequest, default_max_tokens: int,
                        max_choices: int | None = None, *, model_defaults: bool = False) -> list[LLMRequest]:
    """One `llm` request per prompt (a list of prompts fans out; choices follow prompt order).
    `max_choices`: the gateway's max_choices_per_request, prompts x `n` (None: no cap);
    `model_defaults` as chat_request's."""
    _refuse_unsupported(request)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise unsupported("prompt", "must be a string or a list of strings (token-id prompts are not supported)")
    _check_choices(len(prompts), request.n, max_choices)
    best_of = getattr(request, "best_of", None)
    if best_of not in (None, request.n):
        raise unsupported("best_of", f"must equal `n` ({request.n}) here; best-of ranking is not supported")
    max_tokens = request.max_tokens or default_max_tokens
    sampling = _sampling(request, max_tokens, request.logprobs, model_defaults)
    texts = [p for p in prompts if isinstance(p, str)]  # every one of them, as checked above
    return [
        LLMRequest(text=p, sampling=sampling, stream=request.stream, echo=request.echo, top_logprobs=request.logprobs)
        for p in texts
    ]


def _check_choices(prompts: int, n: int, max_choices: int | None) -> None:
    """A request fans out into prompts x n sequences: at most the gateway's cap."""
    if max_choices is None or prompts * n <= max_choices:
        return
    cap = f"at most {max_choices} per request ({knob('max_choices_per_request')})"
    if prompts == 1:
        raise OpenAIError(400, f"`n`: asks for {n} choices; {cap}", param="n", code="too_many_choices")
    raise OpenAIError(400, f"`prompt` x `n`: {prompts} prompts x n={n} = {prompts * n} choices; {cap}",
                      param="prompt" if prompts > max_choices else "n", code="too_many_choices")


def _sampling(request: SamplingFields, max_tokens: int, logprobs: int | None, model_defaults: bool) -> dict[str, Any]:
    values: dict[str, Any] = {"max_tokens": max_tokens}
    if model_defaults:
        values[USE_MODEL_DEFAULTS] = True
    for name in _PASSED_THROUGH:
        value = getattr(request, name, None)
        if value is not None:
            values[name] = value
    if request.stop:
        values["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    if logprobs is not None:
        values["logprobs"] = logprobs
    values.update(_structured(request))
    return values


def _structured(request: SamplingFields) -> dict[str, Any]:
    """`response_format` (json_object, json_schema) and vLLM's grammar fields, as `llm`'s
    structured outputs."""
    extra = request.model_extra or {}
    values = {name: extra[name] for name in _GRAMMAR_KEYS if extra.get(name) is not None}
    response_format = extra.get("response_format")
    if response_format in (None, {"type": "text"}):
        return values
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if values and kind in ("json_object", "json_schema"):
        raise OpenAIError(400, f"`response_format` and `{next(iter(values))}` both constrain the output; send one",
                          param="response_format")
    if kind == "json_object":
        return {"structured_outputs": {"json_object": True}}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(400, "`response_format.json_schema.schema`: must be a JSON schema object",
                              param="response_format.json_schema.schema")
        return {"structured_outputs": {"json": schema}}
    raise unsupported("response_format", "must be of type text, json_object or json_schema")


def _message(index: int, message: ChatMessage, images: list[Image]) -> dict[str, Any]:
    """A message as the chat template reads it: text content (parts with images: the parts, each
    image an {"type": "image"} placeholder, its image appended to `images`); an assistant turn's
    `tool_calls` with their arguments as objects (what templates expect); a tool turn's
    `tool_call_id`."""
    extra = message.model_extra or {}
    content: Any = message.content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for number, part in enumerate(content):
            if part.type == "image_url":
                images.append(image_of_part(part, f"messages[{index}].content[{number}]"))
                parts.append({"type": "image"})
            elif part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            else:
                raise unsupported(f"messages[{index}].content", f"has a part of type {part.type!r}; text and image_url "
                                                               "are supported")
        with_images = any(part["type"] == "image" for part in parts)
        content = parts if with_images else "".join(part["text"] for part in parts)
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if extra.get("tool_calls"):
        if message.role != "assistant":
            raise unsupported(f"messages[{index}].tool_calls", "only an assistant message carries tool calls")
        out["tool_calls"] = [_past_call(f"messages[{index}].tool_calls[{i}]", call)
                             for i, call in enumerate(extra["tool_calls"])]
    if message.role == "tool":
        call_id = extra.get("tool_call_id")
        if not isinstance(call_id, str):
            raise OpenAIError(400, f"`messages[{index}].tool_call_id`: a tool message must name the call it answers",
                              param=f"messages[{index}].tool_call_id")
        out["tool_call_id"] = call_id
    if message.name is not None and message.role == "tool":
        out["name"] = message.name
    return out


def _past_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(400, f"`{where}`: must be {{\"id\", \"type\": \"function\", \"function\": "
                               f"{{\"name\", \"arguments\"}}}}", param=where)
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as error:
        raise OpenAIError(400, f"`{where}.function.arguments`: is not valid JSON ({error.msg})",
                          param=f"{where}.function.arguments") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": parsed}}


def _refuse_unsupported(request: SamplingFields) -> None:
    extra = request.model_extra or {}
    for name, neutral in _REFUSED.items():
        value = extra.get(name)
        if value not in neutral:
            raise unsupported(name)
    modalities = extra.get("modalities")
    if modalities not in (None, ["text"]):
        raise unsupported("modalities", "other than [\"text\"] is not supported")
