"""SamplingParams: how one request samples and when it stops, validated on creation.

`from_dict` accepts JSON-ish values (numbers as strings, "true"/"false"), since
Triton's vLLM-style `sampling_parameters` input carries them that way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import InvalidRequestError
from .structured_output import REQUEST_KEYS as GRAMMAR_KEYS, StructuredOutputs
from .values import to_bool, to_float, to_int

_MAX_LOGPROBS = 20
MAX_N = 16


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate."""
    n: int = 1
    """Parallel samples of the prompt (they share its KV blocks)."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens exist."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens seen in the prompt or output (divides positive logits)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same output."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; trimmed from the output unless include_stop_str_in_output."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (besides EOS)."""
    bad_words_ids: list[list[int]] = field(default_factory=list)
    """Token sequences that must never be generated."""
    bad_words: list[str] = field(default_factory=list)
    """Words that must never be generated (vLLM's key); the engine adds their token ids."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream_interval: int | None = None
    """Tokens gathered into each streamed delta (vLLM's key): raises the engine's `stream_interval`
    for this request, never lowers it. The first and the final delta go out at once."""
    structured_outputs: StructuredOutputs | None = None
    """The grammar every sampled token must follow (backend/structured_output.py)."""
    lora_name: str | None = None
    """The LoRA adapter this request runs with: a name the model's `lora_modules` list (its
    multi_lora.json, as Triton's vLLM backend reads it); None: the base model."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def ending_token_ids(self, eos_token_ids: list[int]) -> frozenset[int]:
        """Token ids that end this request once min_tokens exist (and are masked before).

        The one statement of the rule: the sampler masks these, the scheduler finishes on them.
        Kept per `eos_token_ids` list (the scheduler asks with its own for every request at every
        step); the parameters do not change once a request holds them."""
        kept = self.__dict__.setdefault("_ending", {})
        key = (id(eos_token_ids), tuple(self.stop_token_ids), self.ignore_eos)  # a caller may change its params
        entry = kept.get(key)
        if entry is None or entry[0] is not eos_token_ids:
            ending = frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))
            entry = kept[key] = (eos_token_ids, ending)
        return entry[1]

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling this request's next token needs all its earlier tokens on the
        host (penalties, bad words, min_tokens) or hands values back (logprobs): the engine
        then finishes each step before scheduling the next (no async scheduling)."""
        return (self.needs_penalties or bool(self.bad_words_ids) or self.min_tokens > 0 or self.logprobs is not None
                or self.structured_outputs is not None)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SamplingParams":
        """Build from a JSON object; casts "0"/"1500"/"true" and names any bad field."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        constraint = StructuredOutputs.from_request(values)
        if constraint is not None:
            kwargs["structured_outputs"] = constraint
        for key, value in values.items():
            if key in GRAMMAR_KEYS:
                continue
            if key in VLLM_NEUTRAL_ONLY:
                _check_neutral(key, value)
                continue
            if key not in names:
                raise InvalidRequestError(
                    key, f"unknown sampling parameter; known: {sorted(set(names) | set(VLLM_NEUTRAL_ONLY))}"
                )
            kwargs[key] = _cast(key, value, str(names[key].type))
        return cls(**kwargs)

    def _validate(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be in [0, 100], got {self.temperature}",
        )
        _check(-1 <= self.top_k < 2**31, "top_k", f"must be -1, 0 (disabled) or in [1, 2^31), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", f"must be in [0, 2^63), got {self.seed}")
        _check(self.lora_name is None or (isinstance(self.lora_name, str) and bool(self.lora_name)), "lora_name",
               f"must be the name of an adapter (a non-empty string), got {self.lora_name!r}")
        if self.stream_interval is not None:
            _check(self.stream_interval >= 1, "stream_interval", f"must be >= 1, got {self.stream_interval}")
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= _MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a list of non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative token ids",
        )
        _check(
            all(
                isinstance(w, list) and w and all(isinstance(t, int) and t >= 0 for t in w)
                for w in self.bad_words_ids
            ),
            "bad_words_ids",
            "must be a list of non-empty lists of token ids",
        )

    def check_limits(self, max_stop_strings: int, max_stop_chars: int, max_bad_words: int) -> None:
        """The per-request work the engine's configuration allows (EngineConfig's caps)."""
        _check(len(self.stop) <= max_stop_strings, "stop",
               f"has {len(self.stop)} strings; at most {max_stop_strings} (the model's max_stop_strings)")
        longest = max((len(s) for s in self.stop), default=0)
        _check(longest <= max_stop_chars, "stop",
               f"has a string of {longest} characters; at most {max_stop_chars} (the model's max_stop_chars)")
        words = len(self.bad_words) + len(self.bad_words_ids)
        _check(words <= max_bad_words, "bad_words",
               f"has {words} words (bad_words and bad_words_ids); at most {max_bad_words} (the model's max_bad_words)")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("bad_words_ids", [t for w in self.bad_words_ids for t in w]),
        ):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")


# Keys of vLLM's SamplingParams that a client of Triton's vLLM backend may send and that
# pagedserve does not implement: accepted at the value that changes nothing, refused
# (naming the key) otherwise. key -> (neutral values, what is missing).
VLLM_NEUTRAL_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "best_of > 1 is not supported; use n"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not supported"),
    "early_stopping": ((False,), "early_stopping applies to beam search, which is not supported"),
    "prompt_logprobs": ((None,), "prompt logprobs are not returned by the Triton models"),
    "detokenize": ((True,), "detokenize=false is not supported; the text models always detokenize"),
    "spaces_between_special_tokens": ((True,), "spaces_between_special_tokens=false is not supported"),
    "logits_processors": (([],), "custom logits processors are not supported"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "allowed_token_ids": (([],), "allowed_token_ids is not supported"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported; shorten the prompt"),
    "output_kind": ((0, 1, 2, "CUMULATIVE", "DELTA", "FINAL_ONLY"), "output_kind is set by the `stream` input"),
    "extra_args": (({},), "extra_args is not supported"),
}


def _check_neutral(key: str, value: Any) -> None:
    neutral, missing = VLLM_NEUTRAL_ONLY[key]
    if value is None:
        return
    try:
        if isinstance(neutral[0], bool):
            value = to_bool(value)
        elif isinstance(neutral[0], int) and not isinstance(value, (dict, list)):
            value = to_int(value)
        elif isinstance(neutral[0], float):
            value = to_float(value)
    except ValueError:
        pass  # not castable: it cannot be neutral either
    if value not in neutral:
        raise InvalidRequestError(key, f"{missing} (got {value!r}; pagedserve accepts only {neutral[0]!r} here)")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(name, message)


def _cast(name: str, value: Any, kind: str) -> Any:
    """Cast a JSON value to the field's type, accepting numbers written as strings."""
    try:
        if value is None:
            if "None" in kind:
                return None
            raise ValueError
        if kind.startswith("int"):
            return to_int(value)
        if kind.startswith("float"):
            return to_float(value)
        if kind.startswith("bool"):
            return to_bool(value)
        if kind == "list[str]":
            if isinstance(value, str):
                return [value]
            if not isinstance(value, list):
                raise ValueError
            return [str(v) for v in value]
        if kind == "list[int]":
            if not isinstance(value, list):
                raise ValueError
            return [to_int(v) for v in value]
        if kind == "list[list[int]]":
            if not isinstance(value, list):
                raise ValueError
            return [[to_int(t) for t in w] if isinstance(w, list) else [to_int(w)] for w in value]
    except (TypeError, ValueError):
        raise InvalidRequestError(name, f"expected {kind}, got {value!r}") from None
    return value
