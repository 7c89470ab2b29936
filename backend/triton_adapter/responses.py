"""Building responses: the engine's token-id outputs and the text a client reads.

Outputs are the vLLM backend's: `text_output`, `finish_reason`,
`cumulative_logprob`, `logprobs`, `num_input_tokens`, `num_output_tokens`
(per-response deltas), each present only when its return_* flag is set.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import InvalidRequestError
from ..outputs import RequestOutput
from ..tokenizer import decode_delta
from .finals import ERROR_OUTPUT
from .requests import CORE_OUTPUTS, RETURN_OUTPUTS, EngineRequest
from .tensors import Arrays, flag, token_ids

CLIENT_OUTPUTS = tuple(RETURN_OUTPUTS.values())
"""Outputs a text client gets as the engine makes them."""
ENGINE_OUTPUTS = (*CORE_OUTPUTS, *CLIENT_OUTPUTS, ERROR_OUTPUT)
TEXT_LEVEL_INPUTS = ("text_input", "messages", "tools", "chat_template_kwargs", "apply_chat_template", "image")
"""`llm` inputs it consumes itself; the rest go on to the engine unchanged."""


def engine_response(request: EngineRequest, output: RequestOutput, tokenizer: Any,
                    only: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The outputs of `request.outputs` (only those: see requests.select_outputs), and of
    those only the ones named in `only` where given.

    Per-sample outputs hold one entry per sample, in sample order (vLLM's backend
    with `n`); the token ids of all samples travel concatenated, split by
    `output_lengths` / `context_lengths`."""
    samples = output.per_sample()
    ids, context = [], []
    for sample in samples:
        if request.exclude_input:
            ids.append(sample.new_token_ids)
            context.append(sample.context_token_ids)
        else:
            ids.append(request.prompt_token_ids + sample.new_token_ids)
            context.append([])
    build = {
        "output_ids": lambda: _concat(ids),
        "output_lengths": lambda: np.asarray([len(i) for i in ids], dtype=np.int32),
        "context_ids": lambda: _concat(context),
        "context_lengths": lambda: np.asarray([len(c) for c in context], dtype=np.int32),
        "trim_chars": lambda: np.asarray([s.trim_chars for s in samples], dtype=np.int32),
        "skip_special_tokens": lambda: np.asarray([request.params.skip_special_tokens], dtype=np.bool_),
        "finished": lambda: np.asarray([output.finished], dtype=np.bool_),
        # vLLM's backend: the string "None" until that sample's last response
        "finish_reason": lambda: np.array([str(s.finish_reason if s.finished else None) for s in samples], dtype=np.object_),
        "cumulative_logprob": lambda: np.array([s.cumulative_logprob or 0.0 for s in samples], dtype=np.float32),
        "logprobs": lambda: np.array(
            [logprobs_json(s, tokenizer) if request.logprobs_json else "null" for s in samples], dtype=np.object_
        ),
        "num_input_tokens": lambda: np.array([len(request.prompt_token_ids)], dtype=np.uint32),
        "num_output_tokens": lambda: np.array([len(s.new_token_ids) for s in samples], dtype=np.uint32),
    }
    wanted = request.outputs if only is None else request.outputs.intersection(only)
    return {name: make() for name, make in build.items() if name in wanted}


def _concat(id_lists: list[list[int]]) -> np.ndarray:
    return np.asarray([t for ids in id_lists for t in ids], dtype=np.int32)


def logprobs_json(output: RequestOutput, tokenizer: Any) -> str:
    """vLLM backend shape: one {token_id: {logprob, rank, decoded_token}} per new token,
    the sampled token first and then the top alternatives by rank, as vLLM v1 orders them
    (clients such as the OpenAI gateway read the first entry as the sampled token)."""
    positions = []
    for lp in output.logprobs:
        entry = {str(lp.token_id): _logprob_entry(tokenizer, lp.token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), _logprob_entry(tokenizer, t, v, rank))
        positions.append(entry)
    return json.dumps(positions)


def _logprob_entry(tokenizer: Any, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One response for a non-streaming request: all deltas as one (updates `first`, sample by sample)."""
    for mine, theirs in zip(first.samples, later.samples):
        merge_outputs(mine, theirs)
    first.new_token_ids = first.new_token_ids + later.new_token_ids
    first.text += later.text
    first.logprobs = first.logprobs + later.logprobs
    first.finished, first.finish_reason = later.finished, later.finish_reason
    first.trim_chars, first.error = later.trim_chars, later.error
    first.num_output_tokens = later.num_output_tokens
    first.cumulative_logprob = later.cumulative_logprob
    return first


def postprocess_texts(inputs: Arrays, tokenizer: Any) -> list[str]:
    """`postprocessing`: each sample's text of released ids after their context ids,
    minus what a stop string trimmed. Stateless: everything needed rides on the inputs."""
    id_lists = split_samples(inputs, "output_ids", "output_lengths")
    context_lists = split_samples(inputs, "context_ids", "context_lengths") if "context_ids" in inputs else [[] for _ in id_lists]
    trims = token_ids(inputs, "trim_chars") if "trim_chars" in inputs else [0] * len(id_lists)
    if not len(context_lists) == len(trims) == len(id_lists):
        raise InvalidRequestError("trim_chars", f"has {len(trims)} entries for {len(id_lists)} samples")
    skip = flag(inputs, "skip_special_tokens", default=True)
    texts = []
    for ids, before, trim in zip(id_lists, context_lists, trims):
        # `or ""`: for the type checker, decode_delta is never None with allow_partial
        text = (decode_delta(tokenizer, before, ids, skip, allow_partial=True) or "") if ids else ""
        texts.append(text[: len(text) - trim] if trim else text)
    return texts


def split_samples(inputs: Arrays, ids_name: str, lengths_name: str) -> list[list[int]]:
    """The samples' ids of `ids_name` (concatenated), cut at `lengths_name` (one sample when it is absent)."""
    ids = token_ids(inputs, ids_name)
    if lengths_name not in inputs:
        return [ids]
    lengths = token_ids(inputs, lengths_name)
    if sum(lengths) != len(ids) or min(lengths, default=0) < 0:
        raise InvalidRequestError(lengths_name, f"{lengths} does not split {len(ids)} ids")
    offsets = np.cumsum([0, *lengths])
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(lengths))]


def text_response(engine_outputs: Arrays, tokenizer: Any, with_text: bool = True) -> dict[str, np.ndarray]:
    """`llm`'s response: the text delta of each sample of an engine response
    (unless the client named outputs without `text_output`) plus the client-facing
    outputs it carries."""
    return client_response(engine_outputs, postprocess_texts(engine_outputs, tokenizer) if with_text else None)


def client_response(engine_outputs: Arrays, texts: list[str] | None) -> dict[str, np.ndarray]:
    """`llm`'s response: each sample's text delta (`texts`; None: the client named outputs
    without `text_output`) plus the client-facing outputs the engine response carries."""
    tensors = {n: engine_outputs[n] for n in CLIENT_OUTPUTS if n in engine_outputs}
    if texts is not None:
        tensors = {"text_output": np.array(texts, dtype=np.object_), **tensors}
    return tensors
