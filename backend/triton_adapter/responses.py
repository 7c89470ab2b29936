"""Building responses: `llm_engine`'s token-id outputs and the text a client reads.

Outputs are the vLLM backend's: `text_output`, `finish_reason`,
`cumulative_logprob`, `logprobs`, `num_input_tokens`, `num_output_tokens`
(per-response deltas), each present only when its return_* flag is set.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..outputs import RequestOutput
from ..tokenizer import decode_delta
from .finals import ERROR_OUTPUT
from .requests import CORE_OUTPUTS, RETURN_OUTPUTS, EngineRequest
from .tensors import Arrays, flag, scalar, token_ids

CLIENT_OUTPUTS = tuple(RETURN_OUTPUTS.values())
"""Outputs `llm` passes on from `llm_engine` unchanged."""
ENGINE_OUTPUTS = (*CORE_OUTPUTS, *CLIENT_OUTPUTS, ERROR_OUTPUT)
TEXT_LEVEL_INPUTS = ("text_input", "messages", "apply_chat_template")
"""`llm` inputs it consumes itself; the rest go on to `llm_engine` unchanged."""


def engine_response(request: EngineRequest, output: RequestOutput, tokenizer: Any) -> dict[str, np.ndarray]:
    """The outputs of `request.outputs` (only those: see requests.select_outputs)."""
    ids, context = output.new_token_ids, output.context_token_ids
    if not request.exclude_input:
        ids, context = request.prompt_token_ids + ids, []
    build = {
        "output_ids": lambda: np.asarray(ids, dtype=np.int32),
        "context_ids": lambda: np.asarray(context, dtype=np.int32),
        "trim_chars": lambda: np.asarray([output.trim_chars], dtype=np.int32),
        "skip_special_tokens": lambda: np.asarray([request.params.skip_special_tokens], dtype=np.bool_),
        "finished": lambda: np.asarray([output.finished], dtype=np.bool_),
        # vLLM's backend: the string "None" until the last response
        "finish_reason": lambda: np.array([str(output.finish_reason if output.finished else None)], dtype=np.object_),
        "cumulative_logprob": lambda: np.array([output.cumulative_logprob or 0.0], dtype=np.float32),
        "logprobs": lambda: np.array([logprobs_json(output, tokenizer) if request.logprobs_json else "null"], dtype=np.object_),
        "num_input_tokens": lambda: np.array([len(request.prompt_token_ids)], dtype=np.uint32),
        "num_output_tokens": lambda: np.array([len(output.new_token_ids)], dtype=np.uint32),
    }
    return {name: make() for name, make in build.items() if name in request.outputs}


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


def text_response(engine_outputs: Arrays, tokenizer: Any, with_text: bool = True) -> dict[str, np.ndarray]:
    """`llm`'s response: the text delta of an `llm_engine` response (unless the client
    named outputs without `text_output`) plus the client-facing outputs it carries."""
    tensors = {n: engine_outputs[n] for n in CLIENT_OUTPUTS if n in engine_outputs}
    if with_text:
        tensors = {"text_output": np.array([postprocess_text(engine_outputs, tokenizer)], dtype=np.object_), **tensors}
    return tensors
