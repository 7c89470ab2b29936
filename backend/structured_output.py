"""Structured outputs: a grammar per request that every sampled token must follow.

A request names one constraint (vLLM's `structured_outputs` keys, or the older `guided_*`
ones): a JSON schema, any JSON object, a regular expression, an EBNF grammar, a choice among
strings, or a structural tag. xgrammar compiles it against the model's vocabulary once
(cached by its text) on the thread that admits the request, not the engine's; each step the
constrained rows' logits are masked by one batched token bitmask (only the rows whose draw
breaks the grammar, where the sampler can tell: backend/sampler.py), and each sampled token
advances the request's matcher. End-of-sequence is allowed only where the grammar accepts,
and a request whose grammar is complete ends there.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
LEGACY_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar", "guided_json_object": "json_object"}
"""vLLM's keys before `structured_outputs` (Triton's vLLM backend passes them through)."""
BACKEND_KEYS = ("guided_decoding_backend", "guided_whitespace_pattern")
REQUEST_KEYS = frozenset({"structured_outputs", "guided_decoding", *LEGACY_KEYS, *BACKEND_KEYS})
"""Every sampling_parameters key StructuredOutputs.from_request reads."""
BACKENDS = ("", "auto", "xgrammar")
_WHERE = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")
"""The time and C++ source location xgrammar puts before its messages."""
MAX_WHITESPACE = 4
"""Whitespace a JSON grammar allows in a row: without a bound a sampling model can fill
max_tokens with spaces and the JSON never closes."""


@dataclass
class StructuredOutputs:
    """The one constraint of a request: its kind and its text (a JSON text for json, choice
    and structural_tag)."""

    kind: str
    spec: str
    compact: bool = False
    """JSON without whitespace between its tokens (vLLM's `disable_any_whitespace`): fewer
    tokens, and none a sampled model can waste on blank space."""
    compiled: Any = field(default=None, repr=False, compare=False)
    """xgrammar's CompiledGrammar, set at admission (GrammarCompiler.prepare)."""

    @property
    def field(self) -> str:
        return f"structured_outputs.{self.kind}"

    @classmethod
    def from_request(cls, values: Mapping[str, Any]) -> StructuredOutputs | None:
        """The constraint in a sampling_parameters object, or None; a named error when it is
        malformed or names more than one kind."""
        found: dict[str, Any] = {}
        compact = False
        nested, backend = values.get("structured_outputs"), values.get("guided_decoding_backend")
        if values.get("guided_decoding") is not None:  # vLLM's name for structured_outputs before v0.10
            if nested is not None:
                raise InvalidRequestError("guided_decoding", "give structured_outputs or guided_decoding, not both")
            nested = values["guided_decoding"]
            if isinstance(nested, Mapping) and nested.get("backend") is not None:
                nested = {k: v for k, v in nested.items() if k != "backend"}
                backend = backend if backend is not None else values["guided_decoding"]["backend"]
        if nested is not None:
            if not isinstance(nested, Mapping):
                raise InvalidRequestError("structured_outputs", f"must be an object with one of {list(KINDS)}")
            unknown = sorted(set(nested) - set(KINDS) - {"disable_any_whitespace", "disable_fallback",
                                                           "disable_additional_properties", "whitespace_pattern"})
            if unknown:
                raise InvalidRequestError("structured_outputs", f"unknown key(s) {unknown}; use one of {list(KINDS)}")
            found.update({k: v for k, v in nested.items() if k in KINDS and v not in (None, False)})
            compact = nested.get("disable_any_whitespace") is True
        for key, kind in LEGACY_KEYS.items():
            if values.get(key) not in (None, False):
                found[kind] = values[key]
        if backend is not None and str(backend).split(":")[0] not in BACKENDS:
            raise InvalidRequestError("guided_decoding_backend", f"{backend!r} is not offered; use 'xgrammar' (or leave it out)")
        if not found:
            return None
        if len(found) > 1:
            raise InvalidRequestError("structured_outputs", f"names {sorted(found)}; give exactly one")
        (kind, value), = found.items()
        return cls(kind, _spec_text(kind, value), compact)


def _spec_text(kind: str, value: Any) -> str:
    name = f"structured_outputs.{kind}"
    if kind == "json_object":
        return ""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(name, "must be a non-empty list of non-empty strings")
        return json.dumps(value)
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            try:
                json.loads(value)
            except ValueError as error:
                raise InvalidRequestError(name, f"is not valid JSON ({error})") from None
            return value
        if isinstance(value, (Mapping, bool)):
            return json.dumps(value)
        raise InvalidRequestError(name, "must be a JSON schema (an object, or its JSON text)")
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(name, "must be a non-empty string")
    return value


class GrammarCompiler:
    """xgrammar's compiler for one model's vocabulary; compiled grammars cached by their text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.lock = threading.Lock()

    def prepare(self, constraint: StructuredOutputs) -> None:
        """Compile the request's grammar (once per text; later requests reuse it). A grammar
        that does not compile is the request's error, naming the field."""
        if constraint.compiled is not None:
            return
        try:
            with self.lock:  # one compile at a time; a text compiled before comes from the cache
                constraint.compiled = self._compile(constraint)
        except InvalidRequestError:
            raise
        except Exception as error:  # noqa: BLE001 - xgrammar's own: a bad schema, regex or grammar
            lines = str(error).strip().splitlines()
            message = _WHERE.sub("", lines[0]) if lines else type(error).__name__
            raise InvalidRequestError(constraint.field, f"does not compile: {message[:300]}") from None

    def _compile(self, constraint: StructuredOutputs) -> Any:
        compiler, kind, spec = self.compiler, constraint.kind, constraint.spec
        # json_object: any object, whitespace bounded (xgrammar's builtin JSON grammar is not)
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            if constraint.compact:
                return compiler.compile_json_schema(schema, any_whitespace=False)
            return compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "grammar":
            return compiler.compile_grammar(spec)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec)))
        value = json.loads(spec)
        if isinstance(value, dict) and "structures" in value:  # vLLM's older form: begin / schema / end, triggers
            tags = [self.xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(item.get("schema", {})),
                                               end=item["end"]) for item in value["structures"]]
            return compiler.compile_structural_tag(tags, list(value.get("triggers", [])))
        return compiler.compile_structural_tag(spec)

    def matcher(self, constraint: StructuredOutputs) -> Any:
        """A sequence's own matcher of its (prepared) grammar."""
        return self.xgr.GrammarMatcher(constraint.compiled)


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Mask, in place, the tokens each of `rows` may not take next under its matcher's grammar.
    The rows' masks are filled by xgrammar's batch filler on torch's CPU threads (a JSON
    grammar's row can take milliseconds; one at a time they add up across a batch)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    _batch_filler(torch.get_num_threads()).batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def draft_masks(matcher: Any, drafts: list[int], bitmask: torch.Tensor, first: int) -> int:
    """A verifying request's rows' masks (speculative decoding), written into bitmask rows first
    .. first + len(drafts): row j allows what the grammar allows after the request's tokens and
    drafts 1..j. From the first draft the grammar refuses (or the first after it is complete)
    on, rows repeat the last mask: a verify stops at that draft, so those rows' tokens are never
    kept, and they must still allow something. The matcher is left as it was. Returns the
    number of drafts the grammar accepts."""
    matcher.fill_next_token_bitmask(bitmask, first)
    accepted = 0
    for j, token in enumerate(drafts, start=1):
        if accepted == j - 1 and not matcher.is_terminated() and matcher.accept_token(token):
            accepted = j
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, first + j)
                continue
        bitmask[first + j] = bitmask[first + j - 1]
    if accepted:
        matcher.rollback(accepted)
    return accepted


def accepted_prefix(matcher: Any, drafts: list[int]) -> int:
    """How many leading drafts the grammar accepts; the matcher is left as it was."""
    accepted = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return accepted


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask, in place, logits' `rows` by the same rows of a filled bitmask."""
    import xgrammar as xgr

    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def bitmask_allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def allows(matcher: Any, token: int) -> bool:
    """Whether the matcher's grammar allows `token` next; the matcher is left as it was (the
    engine advances it when the step's tokens are applied)."""
    if not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True


@functools.cache
def _batch_filler(threads: int) -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max(1, threads))
