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

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from ..tokenizer import apply_chat_template, encode_prompt
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
RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


@dataclass
class EngineRequest:
    """One parsed `llm_engine` request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input: bool = True
    returns: set[str] = field(default_factory=set)

    def wants(self, flag: str) -> bool:
        return flag in self.returns


def parse_prompt(inputs: Arrays, tokenizer: Any) -> list[int]:
    """Token ids of `text_input` (raw, or chat-templated when `apply_chat_template`),
    or of `messages` (a JSON list of chat messages)."""
    messages = scalar(inputs, "messages")
    text = scalar(inputs, "text_input")
    if messages:
        try:
            parsed = json.loads(messages)
        except json.JSONDecodeError as error:
            raise InvalidRequestError("messages", f"is not valid JSON ({error.msg} at position {error.pos})") from None
        return apply_chat_template(tokenizer, parsed)
    if text is None:
        raise InvalidRequestError("text_input", "is required (or send `messages` as a JSON chat)")
    if not text:
        raise InvalidRequestError("text_input", "is empty; send a non-empty prompt")
    if flag(inputs, "apply_chat_template"):
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    return encode_prompt(tokenizer, text)


def parse_engine_request(inputs: Arrays, tokenizer: Any, request_parameters: str | None = None) -> EngineRequest:
    """Parse an `llm_engine` request (`request_parameters`: Triton's request parameters
    as JSON, read as sampling parameters when `sampling_parameters` is absent)."""
    prompt = token_ids(inputs, "input_ids")
    values = _sampling_json(inputs, request_parameters)
    for name, key in TRTLLM_SCALARS.items():
        value = scalar(inputs, name)
        if value is not None:
            values[key] = value
    stop_words = [w for w in strings(inputs, "stop_words") if w]
    if stop_words:
        values["stop"] = list(values.get("stop") or []) + stop_words
    bad_words = [w for w in strings(inputs, "bad_words") if w]
    if bad_words:
        values["bad_words_ids"] = [list(tokenizer.encode(w, add_special_tokens=False)) for w in bad_words]
    end_id = scalar(inputs, "end_id")
    if end_id is not None:
        values["stop_token_ids"] = list(values.get("stop_token_ids") or []) + [end_id]
    scalar(inputs, "pad_id")  # accepted for compatibility; nothing is padded
    wants_logprobs = flag(inputs, "return_logprobs") or flag(inputs, "return_log_probs")
    wants_cumulative = flag(inputs, "return_cumulative_logprob") or flag(inputs, "return_log_probs")
    if (wants_logprobs or wants_cumulative) and values.get("logprobs") is None:
        values["logprobs"] = 0
    params = SamplingParams.from_dict(values)

    stream = flag(inputs, "stream")
    exclude = scalar(inputs, "exclude_input_in_output")
    if exclude is not None and not isinstance(exclude, (bool, np.bool_)):
        raise InvalidRequestError("exclude_input_in_output", f"must be a BOOL, got {exclude!r}")
    if stream and exclude is False:
        raise InvalidRequestError(
            "exclude_input_in_output", "must not be false when streaming; drop it or set it to true"
        )
    returns = {name for name in RETURN_FLAGS if flag(inputs, name)}
    if wants_logprobs:
        returns.add("return_logprobs")
    if wants_cumulative:
        returns.add("return_cumulative_logprob")
    return EngineRequest(
        prompt_token_ids=prompt,
        params=params,
        stream=stream,
        exclude_input=stream if exclude is None else bool(exclude),
        returns=returns,
    )


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
