"""The Triton LLM request/response contract, as plain numpy (no Triton import).

The `llm` ensemble and the `llm_engine` model accept both contracts in use:
- Triton's vLLM backend: `sampling_parameters` (JSON; numbers may be strings),
  `stream`, `exclude_input_in_output`, `return_*` flags; outputs `text_output`,
  `finish_reason`, `cumulative_logprob`, `logprobs`, `num_input_tokens`,
  `num_output_tokens` (per-response deltas).
- TensorRT-LLM's ensemble: `max_tokens`, `stop_words`, `bad_words`, `end_id`,
  `pad_id`, `top_k`, `top_p`, `temperature`, `min_tokens`/`min_length`,
  `seed`/`random_seed`, penalties, `return_log_probs`, `stream`.
Tensor values override the same key in `sampling_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import InvalidRequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import apply_chat_template, decode_delta, encode_prompt

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
ENGINE_OUTPUTS = (
    "output_ids",
    "context_ids",
    "trim_chars",
    "skip_special_tokens",
    "finished",
    "finish_reason",
    "cumulative_logprob",
    "logprobs",
    "num_input_tokens",
    "num_output_tokens",
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


# -- tensor helpers ----------------------------------------------------------
def scalar(inputs: Mapping[str, np.ndarray], name: str) -> Any:
    """The single value of an optional input (None when absent)."""
    array = inputs.get(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise InvalidRequestError(name, f"must hold exactly one value, got shape {tuple(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        return decode_utf8(name, bytes(value))
    return value.item() if isinstance(value, np.generic) else value


def strings(inputs: Mapping[str, np.ndarray], name: str) -> list[str]:
    array = inputs.get(name)
    if array is None:
        return []
    return [decode_utf8(name, bytes(v)) if isinstance(v, (bytes, np.bytes_)) else str(v) for v in np.asarray(array).reshape(-1)]


def decode_utf8(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(name, f"is not valid UTF-8 (bad byte at position {error.start}); send UTF-8 text") from None


def flag(inputs: Mapping[str, np.ndarray], name: str, default: bool = False) -> bool:
    value = scalar(inputs, name)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidRequestError(name, f"must be a BOOL, got {value!r}")


def token_ids(inputs: Mapping[str, np.ndarray], name: str) -> list[int]:
    array = inputs.get(name)
    if array is None:
        raise InvalidRequestError(name, "is required (the prompt's token ids)")
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise InvalidRequestError(name, f"must be integer token ids, got dtype {array.dtype}")
    return [int(t) for t in array.reshape(-1)]


# -- preprocessing -------------------------------------------------------------
def parse_prompt(inputs: Mapping[str, np.ndarray], tokenizer: Any) -> list[int]:
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


# -- llm_engine request --------------------------------------------------------
def parse_engine_request(
    inputs: Mapping[str, np.ndarray], tokenizer: Any, request_parameters: str | None = None
) -> EngineRequest:
    """Parse an `llm_engine` request; every error names the input at fault."""
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


def _sampling_json(inputs: Mapping[str, np.ndarray], request_parameters: str | None) -> dict[str, Any]:
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


# -- llm_engine response -------------------------------------------------------
def engine_response(request: EngineRequest, output: RequestOutput, tokenizer: Any) -> dict[str, np.ndarray]:
    """Every declared output, always (empty where not asked: ensembles need them all)."""
    ids, context = output.new_token_ids, output.context_token_ids
    if not request.exclude_input:
        ids, context = request.prompt_token_ids + ids, []
    empty_str = np.array([], dtype=np.object_)
    tensors = {
        "output_ids": np.asarray(ids, dtype=np.int32),
        "context_ids": np.asarray(context, dtype=np.int32),
        "trim_chars": np.asarray([output.trim_chars], dtype=np.int32),
        "skip_special_tokens": np.asarray([request.params.skip_special_tokens], dtype=np.bool_),
        "finished": np.asarray([output.finished], dtype=np.bool_),
        "finish_reason": empty_str,
        "cumulative_logprob": np.array([], dtype=np.float32),
        "logprobs": empty_str,
        "num_input_tokens": np.array([], dtype=np.uint32),
        "num_output_tokens": np.array([], dtype=np.uint32),
    }
    if request.wants("return_finish_reason"):
        reason = output.finish_reason if output.finished else None
        tensors["finish_reason"] = np.array([str(reason)], dtype=np.object_)
    if request.wants("return_cumulative_logprob"):
        tensors["cumulative_logprob"] = np.array([output.cumulative_logprob or 0.0], dtype=np.float32)
    if request.wants("return_logprobs"):
        tensors["logprobs"] = np.array([logprobs_json(output, tokenizer)], dtype=np.object_)
    if request.wants("return_num_input_tokens"):
        tensors["num_input_tokens"] = np.array([len(request.prompt_token_ids)], dtype=np.uint32)
    if request.wants("return_num_output_tokens"):
        tensors["num_output_tokens"] = np.array([len(output.new_token_ids)], dtype=np.uint32)
    return tensors


def logprobs_json(output: RequestOutput, tokenizer: Any) -> str:
    """vLLM backend shape: one {token_id: {logprob, rank, decoded_token}} per new token."""
    positions = []
    for lp in output.logprobs:
        entry = {str(t): _logprob_entry(tokenizer, t, v, rank) for rank, (t, v) in enumerate(lp.top, start=1)}
        entry[str(lp.token_id)] = _logprob_entry(tokenizer, lp.token_id, lp.logprob, lp.rank)
        positions.append(entry)
    return json.dumps(positions)


def _logprob_entry(tokenizer: Any, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}


def postprocess_text(inputs: Mapping[str, np.ndarray], tokenizer: Any) -> str:
    """`postprocessing`: the text of released ids after their context ids, minus
    what a stop string trimmed. Stateless: everything needed rides on the inputs."""
    new_ids = token_ids(inputs, "output_ids")
    context = token_ids(inputs, "context_ids") if "context_ids" in inputs else []
    skip = flag(inputs, "skip_special_tokens", default=True)
    trim = scalar(inputs, "trim_chars") or 0
    text = decode_delta(tokenizer, context, new_ids, skip, allow_partial=True) if new_ids else ""
    return text[: len(text) - trim] if trim else text


TEXT_LEVEL_INPUTS = ("text_input", "messages", "apply_chat_template")
CLIENT_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")


def text_response(engine_outputs: Mapping[str, np.ndarray], tokenizer: Any) -> dict[str, np.ndarray]:
    """`llm`'s response: the text delta of an `llm_engine` response plus its client-facing outputs."""
    text = postprocess_text(engine_outputs, tokenizer)
    return {"text_output": np.array([text], dtype=np.object_), **{n: engine_outputs[n] for n in CLIENT_OUTPUTS}}


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One response for a non-streaming request: all deltas as one."""
    first.new_token_ids = first.new_token_ids + later.new_token_ids
    first.text += later.text
    first.logprobs = first.logprobs + later.logprobs
    first.finished, first.finish_reason = later.finished, later.finish_reason
    first.trim_chars, first.error = later.trim_chars, later.error
    first.num_output_tokens = later.num_output_tokens
    first.cumulative_logprob = later.cumulative_logprob
    return first
