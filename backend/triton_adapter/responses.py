"""Building responses: `llm_engine`'s token-id outputs, the text a client reads,
and the Triton error code each of our failures maps to.

Outputs are the vLLM backend's: `text_output`, `finish_reason`,
`cumulative_logprob`, `logprobs`, `num_input_tokens`, `num_output_tokens`
(per-response deltas).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import EngineDeadError, InvalidRequestError, QueueFullError
from ..outputs import RequestOutput
from ..tokenizer import decode_delta
from .requests import EngineRequest
from .tensors import Arrays, flag, scalar, token_ids

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
TEXT_LEVEL_INPUTS = ("text_input", "messages", "apply_chat_template")
"""`llm` inputs it consumes itself; the rest go on to `llm_engine` unchanged."""
CLIENT_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")


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


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One response for a non-streaming request: all deltas as one (updates `first`)."""
    first.new_token_ids = first.new_token_ids + later.new_token_ids
    first.text += later.text
    first.logprobs = first.logprobs + later.logprobs
    first.finished, first.finish_reason = later.finished, later.finish_reason
    first.trim_chars, first.error = later.trim_chars, later.error
    first.num_output_tokens = later.num_output_tokens
    first.cumulative_logprob = later.cumulative_logprob
    return first


def postprocess_text(inputs: Arrays, tokenizer: Any) -> str:
    """`postprocessing`: the text of released ids after their context ids, minus
    what a stop string trimmed. Stateless: everything needed rides on the inputs."""
    new_ids = token_ids(inputs, "output_ids")
    context = token_ids(inputs, "context_ids") if "context_ids" in inputs else []
    skip = flag(inputs, "skip_special_tokens", default=True)
    trim = scalar(inputs, "trim_chars") or 0
    text = decode_delta(tokenizer, context, new_ids, skip, allow_partial=True) if new_ids else ""
    return text[: len(text) - trim] if trim else text


def text_response(engine_outputs: Arrays, tokenizer: Any) -> dict[str, np.ndarray]:
    """`llm`'s response: the text delta of an `llm_engine` response plus its client-facing outputs."""
    text = postprocess_text(engine_outputs, tokenizer)
    return {"text_output": np.array([text], dtype=np.object_), **{n: engine_outputs[n] for n in CLIENT_OUTPUTS}}


def triton_error(pb_utils: Any, error: Exception) -> Any:
    """The client's view of a failed submit: its own mistake (INVALID_ARG), try again
    later (UNAVAILABLE), or ours (INTERNAL, with the exception's type)."""
    if isinstance(error, InvalidRequestError):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
    if isinstance(error, (QueueFullError, EngineDeadError)):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.UNAVAILABLE)
    return pb_utils.TritonError(f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)


def error_response(pb_utils: Any, message: str, code: Any = None) -> Any:
    """An InferenceResponse carrying only an error (Triton's default code when None)."""
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)
