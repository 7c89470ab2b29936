"""`speculative_config`: vLLM's keys, given as a dict (Python API), a JSON object, or
`key=value,key=value` (config.pbtxt and `pagedserve serve --set` cannot carry quotes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..values import setting_items, to_int

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model", "eagle3")
NOT_YET = ("eagle", "medusa", "mtp", "suffix")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
        "draft_length", "model", "draft_tensor_parallel_size", "dtype")
DRAFT_LENGTHS = ("adaptive", "fixed")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_LOOKUP = 5
"""vLLM's SpeculativeConfig: both prompt_lookup bounds unset -> 5 and 5; one unset -> the other's value."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    """vLLM's key: no request drafts in a step while more than this many requests run (a verify
    step at a large batch can cost more than its accepted tokens save); None: at every batch size."""
    draft_length: str = "adaptive"
    """pagedserve's key: `adaptive` drafts, per request and step, only as many tokens as are expected
    to pay for their rows (draft_length.py); `fixed` always up to num_speculative_tokens (vLLM's way)."""
    model: str = ""
    """draft_model: the draft's checkpoint (a Hugging Face directory or a .gguf file), sharing the
    target's tokenizer; eagle3: the EAGLE-3 head's directory."""
    dtype: str = "auto"
    """pagedserve's key, draft_model: the draft's dtype; auto: the target's. A GGUF draft in bfloat16
    or float16 on CPU keeps its quantized blocks (a Q4 draft reads a quarter of bf16's bytes)."""


def parse(value: Any) -> SpeculativeConfig | None:
    """The parsed setting, or None when speculation is off (empty string, None or {})."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    items = setting_items(FIELD, value)
    if not items:
        return None
    unknown = sorted(set(items) - set(KEYS))
    if unknown:
        raise ConfigError(FIELD, f"unknown key(s) {unknown}; known keys: {list(KEYS)}")
    model = str(items.get("model") or "").strip()
    method = str(items.get("method") or ("draft_model" if model else "ngram")).strip().lower()
    if method == "[ngram]":
        method = "ngram"
    if method not in METHODS:
        if method in NOT_YET:
            raise ConfigError(FIELD, f"method {method!r} is not implemented yet; 'ngram' (prompt lookup), "
                                     "'draft_model' and 'eagle3' are")
        raise ConfigError(FIELD, f"method must be 'ngram', 'draft_model' or 'eagle3', got {method!r}")
    if method == "draft_model" and not model:
        raise ConfigError(FIELD, "method 'draft_model' needs `model`: the draft's checkpoint directory or .gguf file")
    if method == "eagle3" and not model:
        raise ConfigError(FIELD, "method 'eagle3' needs `model`: the EAGLE-3 head's checkpoint directory")
    if method == "ngram" and model:
        raise ConfigError(FIELD, f"`model` ({model!r}) is for methods 'draft_model' and 'eagle3'; n-gram drafting "
                                 "needs no weights")
    if items.get("draft_tensor_parallel_size") not in (None, "") and _int(items, "draft_tensor_parallel_size") != 1:
        raise ConfigError(FIELD, "draft_tensor_parallel_size must be 1: the draft runs on one rank, as the target "
                                 f"does while speculating (got {items['draft_tensor_parallel_size']!r})")
    dtype = str(items.get("dtype") or "auto").strip().lower()
    if dtype not in DRAFT_DTYPES:
        raise ConfigError(FIELD, f"dtype must be one of {list(DRAFT_DTYPES)}, got {dtype!r}")
    if dtype != "auto" and method != "draft_model":
        raise ConfigError(FIELD, "dtype is the draft model's; method 'ngram' has none")
    if items.get("num_speculative_tokens") in (None, ""):
        raise ConfigError(FIELD, "num_speculative_tokens is required (the draft tokens proposed per step, >= 1)")
    k = _int(items, "num_speculative_tokens")
    low = _int(items, "prompt_lookup_min") if items.get("prompt_lookup_min") not in (None, "") else None
    high = _int(items, "prompt_lookup_max") if items.get("prompt_lookup_max") not in (None, "") else None
    if low is None and high is None:
        low = high = DEFAULT_LOOKUP
    elif low is None:
        low = high
    elif high is None:
        high = low
    assert low is not None and high is not None
    for name, number in (("num_speculative_tokens", k), ("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if number < 1:
            raise ConfigError(FIELD, f"{name} must be >= 1, got {number}")
    if low > high:
        raise ConfigError(FIELD, f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
    limit = _int(items, "disable_by_batch_size") if items.get("disable_by_batch_size") not in (None, "") else None
    if limit is not None and limit < 1:
        raise ConfigError(FIELD, f"disable_by_batch_size must be >= 1 (or unset), got {limit}")
    draft_length = str(items.get("draft_length") or "adaptive").strip().lower()
    if draft_length not in DRAFT_LENGTHS:
        raise ConfigError(FIELD, f"draft_length must be one of {list(DRAFT_LENGTHS)}, got {draft_length!r}")
    return SpeculativeConfig(method, k, low, high, limit, draft_length, model, dtype)


def _int(items: dict[str, Any], name: str) -> int:
    value = items[name]
    if isinstance(value, bool):
        raise ConfigError(FIELD, f"{name} must be an integer, got {value!r}")
    try:
        return int(to_int(value))
    except (TypeError, ValueError):
        raise ConfigError(FIELD, f"{name} must be an integer, got {value!r}") from None
