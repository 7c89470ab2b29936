"""TensorRT-LLM's Triton contract: the tensors of its `ensemble`, `tensorrt_llm_bls`,
`tensorrt_llm`, `preprocessing` and `postprocessing` models, mapped onto ours.

Teams leaving TensorRT-LLM's backend keep their clients: the same model names,
tensor names, dtypes and `[batch, ...]` shapes. Differences kept on purpose:
- sampling defaults are TensorRT-LLM's: with neither top_k nor top_p set (or both
  0) decoding is greedy;
- stop words end the output and stay in it, as there (vLLM's trim does not apply);
- streamed text is exact (the engine sends the context ids a stateless detokenizer
  needs); TensorRT-LLM's own stateless postprocessing drops leading spaces.
Inputs we cannot honour are refused by name (see REFUSED).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import InvalidRequestError
from ..tokenizer import encode_words
from .tensors import Arrays, flag, scalar, strings, token_ids

TEXT_NAMES = {"max_tokens": "max_tokens", "top_k": "top_k", "top_p": "top_p", "stream": "stream"}
"""Text-level (ensemble, tensorrt_llm_bls) names of the inputs whose token-level names differ."""
TOKEN_NAMES = {"request_output_len": "max_tokens", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
               "streaming": "stream"}
"""The same inputs as `tensorrt_llm` names them."""
SHARED_SCALARS = {
    "temperature": "temperature",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_tokens": "min_tokens",
    "min_length": "min_tokens",
    "seed": "seed",
    "random_seed": "seed",
    "num_return_sequences": "n",
}
"""Inputs named alike in both, and the SamplingParams field each sets."""
BEAM_ONLY = ("length_penalty", "len_penalty", "early_stopping", "beam_search_diversity_rate")
"""Beam-search settings: accepted and without effect at beam width 1, as there."""

LORA_FROM_THE_SERVER = ("LoRA weights are read from the server's multi_lora.json, not sent with requests: list the "
                        "adapter there under a number as its name and send that number as lora_task_id")
REFUSED = {
    "beam_width": (
        "beam search is not supported; send beam_width 1 (or leave it out) and use num_return_sequences for several outputs"
    ),
    "return_context_logits": "context logits are not returned; leave return_context_logits false",
    "return_generation_logits": "generation logits are not returned; leave return_generation_logits false",
    "return_perf_metrics": "per-request perf metrics are not returned; read the server's metrics port instead",
    "prompt_embedding_table": "prompt tables (p-tuning) are not supported",
    "prompt_vocab_size": "prompt tables (p-tuning) are not supported",
    "prompt_table_extra_id": "prompt tables (p-tuning) are not supported",
    "prompt_table_extra_ids": "prompt tables (p-tuning) are not supported",
    "lora_weights": LORA_FROM_THE_SERVER,
    "lora_config": LORA_FROM_THE_SERVER,
    "embedding_bias": "embedding bias is not supported; use bad_words to forbid words",
    "embedding_bias_words": "embedding bias is not supported; use bad_words to forbid words",
    "embedding_bias_weights": "embedding bias is not supported; use bad_words to forbid words",
    "decoder_text_input": "encoder-decoder models are not supported",
    "decoder_input_ids": "encoder-decoder models are not supported",
    "decoder_input_lengths": "encoder-decoder models are not supported",
}
"""Declared inputs we cannot honour: refused with what to do instead. A BOOL among
them is accepted when false, `beam_width` when 1."""
PLACEHOLDERS = {"decoder_input_ids": 2**31 - 1, "decoder_input_lengths": 1}
"""Decoder inputs accepted as the one-token placeholder TensorRT-LLM's preprocessing
sends for decoder-only models (its end_to_end_test forwards them to tensorrt_llm)."""
PREPROCESSING_REFUSED = {"EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
                         "DECODER_QUERY": "decoder_text_input", "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id"}
"""`preprocessing` inputs the ensemble feeds from refused inputs (and the ensemble's names for them)."""

CONTEXT_OUTPUTS = ("context_ids", "context_length", "trim_chars", "skip_special_tokens")
"""Ours, beside TensorRT-LLM's: what `postprocessing` needs for exact streamed text."""


def refuse_unsupported(inputs: Arrays) -> None:
    """An InvalidRequestError naming the first input of REFUSED set to something we cannot honour."""
    for name, array in inputs.items():
        refused = REFUSED.get(name)
        if refused is None:
            continue
        value = np.asarray(array).reshape(-1)
        if value.size == 0 or (value.dtype == np.bool_ and not value.any()):
            continue
        if name == "beam_width" and value.size == 1 and int(value[0]) == 1:
            continue
        if name in PLACEHOLDERS and value.size == 1 and int(value[0]) <= PLACEHOLDERS[name]:
            continue
        raise InvalidRequestError(name, refused)


def single_request(inputs: Arrays, batched: str) -> None:
    """One prompt per request (batch dimension 1): a batch > 1 is refused by name."""
    shape = np.shape(inputs[batched]) if batched in inputs else ()
    if shape and shape[0] > 1:
        raise InvalidRequestError(batched, f"holds a batch of {shape[0]}; send one prompt per request")


# -- word lists ----------------------------------------------------------------


def to_word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's `[2, N]` word list: the words' ids concatenated (padded with 0),
    and each word's end offset (padded with -1). No words: `[[0], [-1]]`."""
    flat = [t for word in words for t in word]
    ends = np.cumsum([len(word) for word in words]).tolist()
    width = max(len(flat), len(ends), 1)
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(flat)] = flat
    out[1, : len(ends)] = ends
    return out


def from_word_list(name: str, array: Any) -> list[list[int]]:
    """The words of a `[2, N]` (or `[1, 2, N]`) word list."""
    array = np.asarray(array)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[0] != 2 or array.dtype.kind not in "iu":
        raise InvalidRequestError(
            name, f"must be an INT32 word list of shape [2, N] (ids, end offsets), got {array.dtype} {list(array.shape)}"
        )
    flat, words, start = array[0].tolist(), [], 0
    for end in array[1].tolist():
        if end < 0:
            break
        if end < start or end > len(flat):
            raise InvalidRequestError(name, f"end offset {end} is out of order or past the {len(flat)} ids")
        if end > start:
            words.append(flat[start:end])
        start = end
    return words


# -- requests ------------------------------------------------------------------


@dataclass
class TrtllmRequest:
    """A TensorRT-LLM-contract request, read into what the engine takes."""

    sampling: dict[str, Any]
    """the engine's `sampling_parameters`."""
    stream: bool
    exclude_input: bool
    with_logprobs: bool


def parse_trtllm_request(
    inputs: Arrays, names: Mapping[str, str], stop: list[str], bad_words_ids: list[list[int]], exclude_default: bool
) -> TrtllmRequest:
    """Sampling settings from TensorRT-LLM's inputs (`names`: TEXT_NAMES or TOKEN_NAMES);
    stop and bad words come already read, as strings and ids."""
    refuse_unsupported(inputs)
    values: dict[str, Any] = {}
    for name, key in {**names, **SHARED_SCALARS}.items():
        value = scalar(inputs, name)
        if value is not None and key != "stream":
            values[key] = value
    if "max_tokens" not in values:
        raise InvalidRequestError(
            _name_of(names, "max_tokens"), "is required (the most tokens to generate: `max_tokens` of the ensemble)"
        )
    top_k, top_p = values.pop("top_k", 0) or 0, values.pop("top_p", 0.0) or 0.0
    if top_k == 1 or (top_k == 0 and top_p == 0.0):
        values["temperature"] = 0.0  # TensorRT-LLM's default: greedy unless top_k or top_p asks to sample
    else:
        values["top_k"], values["top_p"] = top_k, top_p or 1.0
    if stop:
        values["stop"], values["include_stop_str_in_output"] = stop, True
    if bad_words_ids:
        values["bad_words_ids"] = bad_words_ids
    end_id = scalar(inputs, "end_id")
    if end_id is not None:
        values["stop_token_ids"] = [int(end_id)]
    scalar(inputs, "pad_id")  # accepted: outputs are not padded
    for name in BEAM_ONLY:
        scalar(inputs, name)
    task = scalar(inputs, "lora_task_id")
    if task is not None:  # the adapter multi_lora.json lists under this number (enable_lora)
        values["lora_name"] = str(int(task))
    with_logprobs = flag(inputs, "return_log_probs")
    if with_logprobs:
        values["logprobs"] = 0
    values.update(guided_decoding(inputs))
    stream = flag(inputs, _name_of(names, "stream"))
    exclude = flag(inputs, "exclude_input_in_output", exclude_default)
    return TrtllmRequest(values, stream, exclude or stream, with_logprobs)


GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar",
               "structural_tag": "structural_tag"}
"""TensorRT-LLM's `guided_decoding_guide_type` -> vLLM's structured_outputs kind (`json`: any JSON object)."""


def guided_decoding(inputs: Arrays) -> dict[str, Any]:
    """`guided_decoding_guide_type` and `guided_decoding_guide` as a structured_outputs value."""
    kind = scalar(inputs, "guided_decoding_guide_type")
    guide = scalar(inputs, "guided_decoding_guide")
    if kind is None:
        if guide is not None:
            raise InvalidRequestError(
                "guided_decoding_guide_type", f"is required with guided_decoding_guide; one of {sorted(GUIDE_TYPES)}"
            )
        return {}
    kind = str(kind)
    if kind not in GUIDE_TYPES:
        raise InvalidRequestError("guided_decoding_guide_type", f"{kind!r} is not one of {sorted(GUIDE_TYPES)}")
    if GUIDE_TYPES[kind] == "json_object":
        return {"structured_outputs": {"json_object": True}}
    if not guide:
        raise InvalidRequestError("guided_decoding_guide", f"is required with guided_decoding_guide_type {kind!r}")
    return {"structured_outputs": {GUIDE_TYPES[kind]: str(guide)}}


def _name_of(names: Mapping[str, str], key: str) -> str:
    return next(name for name, k in names.items() if k == key)


def engine_inputs(request: TrtllmRequest, prompt_ids: list[int]) -> dict[str, np.ndarray]:
    """the engine's inputs for a request: everything rides in sampling_parameters."""
    return {
        "input_ids": np.asarray(prompt_ids, dtype=np.int32),
        "sampling_parameters": np.array([json.dumps(request.sampling)], dtype=np.object_),
        "stream": np.array([request.stream]),
        "exclude_input_in_output": np.array([request.exclude_input]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
        "return_cumulative_logprob": np.array([request.with_logprobs]),
        "return_logprobs": np.array([request.with_logprobs]),
    }


def prompt_token_ids(inputs: Arrays) -> list[int]:
    """`tensorrt_llm`'s prompt: `input_ids` cut at `input_lengths` (when given)."""
    single_request(inputs, "input_ids")
    ids = token_ids(inputs, "input_ids")
    length = scalar(inputs, "input_lengths")
    if length is not None:
        if not 0 < int(length) <= len(ids):
            raise InvalidRequestError("input_lengths", f"is {length} for {len(ids)} input_ids")
        ids = ids[: int(length)]
    if not ids:
        raise InvalidRequestError("input_ids", "is empty; send the prompt's token ids")
    return ids


def stop_words_of(inputs: Arrays, tokenizer: Any, token_level: bool) -> tuple[list[str], list[list[int]]]:
    """Stop words as strings (the engine matches text) and bad words as token ids."""
    if token_level:
        stop_ids = from_word_list("stop_words_list", inputs["stop_words_list"]) if "stop_words_list" in inputs else []
        bad = from_word_list("bad_words_list", inputs["bad_words_list"]) if "bad_words_list" in inputs else []
        return [tokenizer.decode(word) for word in stop_ids], bad
    stop = [w for w in strings(inputs, "stop_words") if w]
    return stop, encode_words(tokenizer, strings(inputs, "bad_words"))


# -- responses ------------------------------------------------------------------


def sample_outputs(engine_outputs: Arrays, index: int, new_ids: list[int]) -> dict[str, np.ndarray]:
    """TensorRT-LLM's per-sequence outputs of sample `index` of an engine response,
    each with its batch dimension (batch 1, beam 1). Log probs cover generated tokens
    only (zeros when not asked for), also when the prompt rides along in `new_ids`."""
    cumulative = engine_outputs.get("cumulative_logprob")
    logprobs = engine_outputs.get("logprobs")
    counts = engine_outputs.get("num_output_tokens")
    generated = int(counts.reshape(-1)[index]) if counts is not None else len(new_ids)
    per_token = _sampled_logprobs(logprobs.reshape(-1)[index]) if logprobs is not None else []
    if len(per_token) != generated:
        per_token = [0.0] * generated
    prompt_tokens = int(engine_outputs["num_input_tokens"].reshape(-1)[0]) if "num_input_tokens" in engine_outputs else 0
    return {
        "cum_log_probs": np.array([[float(cumulative.reshape(-1)[index]) if cumulative is not None else 0.0]], dtype=np.float32),
        "output_log_probs": np.array(per_token, dtype=np.float32).reshape(1, 1, -1),
        "batch_index": np.array([[0]], dtype=np.int32),
        "sequence_index": np.array([[index]], dtype=np.int32),
        "num_input_tokens": np.array([[prompt_tokens]], dtype=np.int32),
        "num_output_tokens": np.array([[generated]], dtype=np.int32),
    }


def _sampled_logprobs(raw: Any) -> list[float]:
    """The sampled token's logprob at each position of the engine's logprobs JSON (first entry)."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    positions = json.loads(text) if text and text != "null" else []
    return [float(next(iter(entry.values()))["logprob"]) for entry in positions or []]


def samples_to_send(id_lists: list[list[int]], stream: bool) -> list[int]:
    """Which samples of an engine response become responses: in a stream those with
    new ids; otherwise (one merged response) all of them."""
    if not stream:
        return list(range(len(id_lists)))
    return [i for i, ids in enumerate(id_lists) if ids]


def keep(tensors: Mapping[str, np.ndarray], requested: Iterable[str]) -> dict[str, np.ndarray]:
    wanted = set(requested)
    return {name: array for name, array in tensors.items() if name in wanted}
