"""Parsing the two LLM request contracts in use on Triton.

- Triton's vLLM backend: `sampling_parameters` (JSON; numbers may be strings),
  `stream`, `exclude_input_in_output`, `return_*` flags.
- TensorRT-LLM's ensemble: `max_tokens`, `stop_words`, `bad_words`, `end_id`,
  `pad_id`, `top_k`, `top_p`, `temperature`, `min_tokens`/`min_length`,
  `seed`/`random_seed`, penalties, `return_log_probs`, `stream`.
Tensor values override the same key in `sampling_parameters`. Every error names
the input at fault, since its message is what the client reads.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from ..tokenizer import apply_chat_template, encode_prompt, encode_words
from ..values import to_bool
from .tensors import Arrays, flag, scalar, strings, token_ids

# TensorRT-LLM-style scalar inputs -> SamplingParams field
TRTLLM_SCALARS = {
    "max_tokens": "max_tokens",
    "top_k": "top_k",
    "top_p": "top_p",
    "temperature": "temperature",
    "min_tokens": "min_tokens",
    "min_length": "min_tokens",
    "seed": "seed",
    "random_seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
RETURN_OUTPUTS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
"""Each return_* flag and the output it adds; an output whose flag is off is absent (vLLM backend)."""
CORE_OUTPUTS = ("output_ids", "output_lengths", "context_ids", "context_lengths", "trim_chars", "skip_special_tokens", "finished")
"""Token-level engine outputs sent whenever requested."""
BLS_CALLER = "bls_caller"


class VerbatimRequestError(InvalidRequestError):
    """An InvalidRequestError whose message is given whole: vLLM backend wording that
    clients compare verbatim (it names the field itself)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.args = (message,)


@dataclass
class EngineRequest:
    """One parsed token-level engine request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input: bool = True
    outputs: frozenset[str] = frozenset()
    """The outputs its responses carry: requested by the caller, and asked for by a return_* flag where one applies."""
    logprobs_json: bool = False
    """The `logprobs` output is a list (the request asked for logprobs) rather than `null`, as in vLLM's backend."""
    bls_caller: bool = False
    """Sent by `llm` over BLS (input `bls_caller`, read by the model): acknowledged at
    once, errors sent as data (see finals.py)."""


def parse_prompt(inputs: Arrays, tokenizer: Any) -> list[int]:
    """Token ids of `text_input` (raw, or chat-templated when `apply_chat_template`),
    or of `messages` (a JSON list of chat messages; `tools`, a JSON list of function
    definitions, and `chat_template_kwargs`, a JSON object of the template's own variables, go to
    the chat template with them)."""
    messages = scalar(inputs, "messages")
    text = scalar(inputs, "text_input")
    if messages:
        tools, template_kwargs = scalar(inputs, "tools"), scalar(inputs, "chat_template_kwargs")
        return apply_chat_template(tokenizer, _json_input("messages", messages),
                                   tools=_json_input("tools", tools) if tools else None,
                                   template_kwargs=_json_input("chat_template_kwargs", template_kwargs)
                                   if template_kwargs else None)
    if text is None:
        raise InvalidRequestError("text_input", "is required (or send `messages` as a JSON chat)")
    if not text:
        raise InvalidRequestError("text_input", "is empty; send a non-empty prompt")
    if flag(inputs, "apply_chat_template"):
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    return encode_prompt(tokenizer, text)


def image_input(inputs: Arrays) -> list[bytes] | None:
    """`image` as Triton's vLLM backend takes it: one base64-encoded image file per element (a
    `data:image/...;base64,` URL's payload too); None when absent."""
    if "image" not in inputs:
        return None
    values = strings(inputs, "image")
    if not values:
        raise InvalidRequestError("image", "is empty; send one base64-encoded image file per element")
    images = []
    for index, value in enumerate(values):
        payload = value.partition(",")[2] if value.startswith("data:") else value
        try:
            images.append(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as error:
            raise InvalidRequestError("image", f"element {index} is not base64 ({error}); send each image file "
                                               "base64-encoded") from None
    return images


def image_prompt(inputs: Arrays, images: list[bytes]) -> dict[str, Any]:
    """The prompt an `image` request's images go into (the engine's prompt dict): `messages`, whose
    image parts ({"type": "image"}) take the images in order through the chat template, or a raw
    `text_input` with a placeholder for each image."""
    messages = scalar(inputs, "messages")
    data = {"image": images}
    if messages:
        template_kwargs = scalar(inputs, "chat_template_kwargs")
        return {"messages": _json_input("messages", messages), "multi_modal_data": data,
                "chat_template_kwargs": _json_input("chat_template_kwargs", template_kwargs) if template_kwargs else None}
    if flag(inputs, "apply_chat_template"):
        raise InvalidRequestError("image", "with `apply_chat_template`: send `messages` with an image part "
                                           "({\"type\": \"image\"}) where each image goes")
    text = scalar(inputs, "text_input")
    if not text:
        raise InvalidRequestError("text_input", "is required with `image` (or `messages`): the prompt, with a "
                                                "placeholder for each image")
    return {"prompt": text, "multi_modal_data": data}


def _json_input(name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(name, f"is not valid JSON ({error.msg} at position {error.pos})") from None


def parse_engine_request(
    inputs: Arrays, tokenizer: Any, request_parameters: str | None = None, requested_outputs: Iterable[str] = (),
    model_defaults: Mapping[str, Any] | None = None,
) -> EngineRequest:
    """Parse a token-level engine request (`request_parameters`: Triton's request parameters
    as JSON, read as sampling parameters when `sampling_parameters` is absent;
    `requested_outputs`: the request's requested output names; `model_defaults`: the model's
    generation_config sampling fields, which fill those a request with `use_model_defaults`
    leaves out)."""
    prompt = token_ids(inputs, "input_ids")
    values = _sampling_json(inputs, request_parameters)
    if _use_model_defaults(values.pop(USE_MODEL_DEFAULTS, False)):
        values = {**(model_defaults or {}), **values}
    for name, key in TRTLLM_SCALARS.items():
        value = scalar(inputs, name)
        if value is not None:
            values[key] = value
    stop_words = [w for w in strings(inputs, "stop_words") if w]
    if stop_words:
        values["stop"] = list(values.get("stop") or []) + stop_words
    bad_words = [w for w in strings(inputs, "bad_words") if w]
    if bad_words:
        values["bad_words_ids"] = encode_words(tokenizer, bad_words)
    end_id = scalar(inputs, "end_id")
    if end_id is not None:
        values["stop_token_ids"] = list(values.get("stop_token_ids") or []) + [end_id]
    scalar(inputs, "pad_id")  # accepted for compatibility; nothing is padded
    returns = requested_returns(inputs)
    logprobs_json = values.get("logprobs") is not None or flag(inputs, "return_log_probs")
    if (logprobs_json or "return_cumulative_logprob" in returns) and values.get("logprobs") is None:
        values["logprobs"] = 0  # the sampled token's logprob is what the cumulative sums
    params = SamplingParams.from_dict(values)
    stream = flag(inputs, "stream")
    exclude = scalar(inputs, "exclude_input_in_output")
    if exclude is not None and not isinstance(exclude, (bool, np.bool_)):
        raise InvalidRequestError("exclude_input_in_output", f"must be a BOOL, got {exclude!r}")
    if stream and exclude is False:
        raise VerbatimRequestError(
            "exclude_input_in_output",
            "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.",
        )
    return EngineRequest(
        prompt_token_ids=prompt,
        params=params,
        stream=stream,
        exclude_input=stream if exclude is None else bool(exclude),
        outputs=select_outputs(requested_outputs, returns, CORE_OUTPUTS),
        logprobs_json=logprobs_json,
    )


def requested_returns(inputs: Arrays) -> set[str]:
    """The return_* flags that are set (TensorRT-LLM's `return_log_probs` sets both logprob ones)."""
    returns = {name for name in RETURN_OUTPUTS if flag(inputs, name)}
    if flag(inputs, "return_log_probs"):
        returns |= {"return_logprobs", "return_cumulative_logprob"}
    return returns


def select_outputs(requested: Iterable[str], returns: set[str], always: Iterable[str]) -> frozenset[str]:
    """What to build: requested outputs among `always` and those a set return_* flag adds.

    Built only when requested because Triton 2.51 prunes an unrequested output after
    the stub released the GIL (freeing its numpy array unsafely)."""
    allowed = set(always) | {RETURN_OUTPUTS[name] for name in returns}
    return frozenset(name for name in requested if name in allowed)


USE_MODEL_DEFAULTS = "use_model_defaults"
"""Our one sampling key beyond vLLM's: true fills the fields the request leaves out from the model's
generation_config.json (ModelConfig.generation_defaults), as vLLM's OpenAI server does for every
request; the vLLM backend's contract (vLLM's own defaults) is kept without it."""


def _use_model_defaults(value: Any) -> bool:
    try:
        return to_bool(value)
    except ValueError:
        raise InvalidRequestError(USE_MODEL_DEFAULTS, f"must be true or false, got {value!r}") from None


def _sampling_json(inputs: Arrays, request_parameters: str | None) -> dict[str, Any]:
    raw = scalar(inputs, "sampling_parameters")
    source = "sampling_parameters"
    if raw is None and request_parameters and request_parameters not in ("{}", ""):
        raw, source = request_parameters, "parameters"
    if raw is None or raw == "":
        return {}
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(source, f"is not valid JSON ({error.msg} at position {error.pos})") from None
    if not isinstance(values, dict):
        raise InvalidRequestError(source, "must be a JSON object such as {\"max_tokens\": 64}")
    return {k: v for k, v in values.items() if v is not None}
