"""The stateless `preprocessing` and `postprocessing` models: the first and last
steps of the `ensemble`, in TensorRT-LLM's tensors (trtllm.py), so its clients that
call the steps one by one work unchanged."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..errors import InvalidRequestError, PagedServeError
from ..tokenizer import encode_prompt, encode_words
from ..values import to_bool
from .arguments import model_parameters, tokenizer_from_args
from .finals import Failure
from .responses import postprocess_texts
from .tensors import Arrays, flag, request_inputs, strings, to_tensors
from .trtllm import PREPROCESSING_REFUSED, refuse_unsupported, to_word_list

Handler = Callable[[Arrays], Mapping[str, np.ndarray]]


def stateless_execute(pb_utils: Any, requests: list[Any], handler: Handler) -> list[Any]:
    """One response per request; a PagedServeError becomes an INVALID_ARG error response
    for that request alone (anything else fails the batch: a bug, not the client's doing)."""
    responses = []
    for request in requests:
        try:
            requested = set(request.requested_output_names())
            outputs = {name: array for name, array in handler(request_inputs(request)).items() if name in requested}
            responses.append(pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, outputs)))
        except PagedServeError as error:
            responses.append(Failure(str(error), "INVALID_ARG").response(pb_utils))
    return responses


class TokenizerModel:
    """A non-decoupled model mapping each request's inputs to outputs with the tokenizer."""

    def __init__(self, pb_utils: Any, tokenizer: Any):
        self.pb_utils = pb_utils
        self.tokenizer = tokenizer

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> TokenizerModel:
        return cls(pb_utils, tokenizer_from_args(args))

    def execute(self, requests: list[Any]) -> list[Any]:
        return stateless_execute(self.pb_utils, requests, self.handle)

    def finalize(self) -> None:
        """Nothing runs between requests."""

    def handle(self, inputs: Arrays) -> dict[str, np.ndarray]:
        raise NotImplementedError


class PreprocessingModel(TokenizerModel):
    """TensorRT-LLM's `preprocessing`: QUERY text -> INPUT_ID (+ lengths, word lists,
    end and pad ids), one row per batch entry."""

    def handle(self, inputs: Arrays) -> dict[str, np.ndarray]:
        for name, ensemble_name in PREPROCESSING_REFUSED.items():
            if name in inputs:
                refuse_unsupported({ensemble_name: inputs[name]})
        if "QUERY" not in inputs:
            raise InvalidRequestError("QUERY", "is required (the prompt text: the ensemble's `text_input`)")
        queries = [strings({"QUERY": row}, "QUERY") for row in _rows(inputs["QUERY"])]
        prompts = [encode_prompt(self.tokenizer, "".join(q)) for q in queries]
        if not all(prompts):
            raise InvalidRequestError("QUERY", "is empty; send a non-empty prompt")
        end_id = _ids_per_row(inputs, "END_ID", self.tokenizer.eos_token_id, len(prompts))
        pad_id = _ids_per_row(inputs, "PAD_ID", self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                              else self.tokenizer.eos_token_id, len(prompts))
        width = max(len(p) for p in prompts)
        input_ids = np.array([p + [pad] * (width - len(p)) for p, pad in zip(prompts, pad_id)], dtype=np.int32)
        outputs = {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": np.array([[len(p)] for p in prompts], dtype=np.int32),
            "BAD_WORDS_IDS": self._word_lists(inputs, "BAD_WORDS_DICT", len(prompts)),
            "STOP_WORDS_IDS": self._word_lists(inputs, "STOP_WORDS_DICT", len(prompts)),
            "OUT_END_ID": np.array([[i] for i in end_id], dtype=np.int32),
            "OUT_PAD_ID": np.array([[i] for i in pad_id], dtype=np.int32),
            # decoder-only models: the one-token placeholder TensorRT-LLM's preprocessing sends
            "DECODER_INPUT_ID": np.array([[i] for i in pad_id], dtype=np.int32),
            "REQUEST_DECODER_INPUT_LEN": np.ones((len(prompts), 1), dtype=np.int32),
        }
        if "REQUEST_OUTPUT_LEN" in inputs:
            outputs["REQUEST_OUTPUT_LEN"] = np.asarray(inputs["REQUEST_OUTPUT_LEN"], dtype=np.int32).reshape(len(prompts), -1)
        return outputs

    def _word_lists(self, inputs: Arrays, name: str, batch: int) -> np.ndarray:
        """[batch, 2, N] word lists of each row's words (TensorRT-LLM's format)."""
        rows = _rows(inputs[name]) if name in inputs else [np.array([], dtype=np.object_)] * batch
        lists = [to_word_list(encode_words(self.tokenizer, strings({name: row}, name))) for row in rows]
        width = max(w.shape[1] for w in lists)
        padded = np.zeros((len(lists), 2, width), dtype=np.int32)
        padded[:, 1, :] = -1
        for i, word_list in enumerate(lists):
            padded[i, :, : word_list.shape[1]] = word_list
        return padded


class PostprocessingModel(TokenizerModel):
    """TensorRT-LLM's `postprocessing`: TOKENS_BATCH [batch, beam, len] cut at
    SEQUENCE_LENGTH -> OUTPUT text, one entry per batch x beam. With our optional CONTEXT_IDS /
    CONTEXT_LENGTH / TRIM_CHARS (sent by `tensorrt_llm`), a streamed delta's text is
    exact: it is decoded after the ids before it, minus what a stop string trimmed."""

    skip_special_tokens: bool = True

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> PostprocessingModel:
        model = cls(pb_utils, tokenizer_from_args(args))
        model.skip_special_tokens = to_bool(model_parameters(args).get("skip_special_tokens") or "true")
        return model

    def handle(self, inputs: Arrays) -> dict[str, np.ndarray]:
        tokens = _beams(inputs, "TOKENS_BATCH")
        lengths = _per_beam(inputs, "SEQUENCE_LENGTH", tokens)
        context = _beams(inputs, "CONTEXT_IDS") if "CONTEXT_IDS" in inputs else None
        context_lengths = _per_beam(inputs, "CONTEXT_LENGTH", context) if context is not None else None
        trims = _per_beam(inputs, "TRIM_CHARS", tokens, absent=0, within_ids=False)
        skip = flag(inputs, "SKIP_SPECIAL_TOKENS", default=self.skip_special_tokens)
        texts = []
        for b in range(tokens.shape[0]):
            row = {
                "output_ids": np.concatenate([tokens[b, k, : lengths[b, k]] for k in range(tokens.shape[1])]),
                "output_lengths": lengths[b],
                "trim_chars": trims[b],
                "skip_special_tokens": np.array([skip]),
            }
            if context is not None and context_lengths is not None:  # sent together
                row["context_ids"] = np.concatenate([context[b, k, : context_lengths[b, k]] for k in range(context.shape[1])])
                row["context_lengths"] = context_lengths[b]
            texts.append(postprocess_texts(row, self.tokenizer))
        # 1-D, batch x beam entries, as TensorRT-LLM's (its clients read text_output[0])
        return {"OUTPUT": np.array([text for row in texts for text in row], dtype=np.object_)}


def _rows(array: np.ndarray) -> list[np.ndarray]:
    """The batch rows of a [batch, ...] input (a [1]-shaped one is one row)."""
    array = np.asarray(array)
    return [array] if array.ndim <= 1 else list(array)


def _ids_per_row(inputs: Arrays, name: str, default: int | None, batch: int) -> list[int]:
    if name not in inputs:
        return [int(default if default is not None else 0)] * batch
    values = np.asarray(inputs[name]).reshape(-1).tolist()
    if len(values) != batch:
        raise InvalidRequestError(name, f"has {len(values)} values for a batch of {batch}")
    return [int(v) for v in values]


def _beams(inputs: Arrays, name: str) -> np.ndarray:
    """An id tensor as [batch, beam, len] (a [len] or [beam, len] one gets the missing dimensions)."""
    array = np.asarray(inputs[name])
    if array.dtype.kind not in "iu":
        raise InvalidRequestError(name, f"must be integer token ids, got {array.dtype}")
    while array.ndim < 3:
        array = array[np.newaxis]
    return array


def _per_beam(inputs: Arrays, name: str, like: np.ndarray, absent: int | None = None, within_ids: bool = True) -> np.ndarray:
    """A per-beam count as [batch, beam], never negative and, `within_ids`, at most the
    ids it cuts (`absent`: its value when not sent; None: all the ids)."""
    if name not in inputs:
        return np.full(like.shape[:2], like.shape[2] if absent is None else absent, dtype=np.int64)
    array = np.asarray(inputs[name]).astype(np.int64)
    if array.size != like.shape[0] * like.shape[1]:
        raise InvalidRequestError(name, f"must hold one value per beam: {list(like.shape[:2])}")
    array = array.reshape(like.shape[:2])
    if (array < 0).any() or (within_ids and (array > like.shape[2]).any()):
        raise InvalidRequestError(name, f"{array.tolist()} is out of range for {like.shape[2]} ids")
    return array
