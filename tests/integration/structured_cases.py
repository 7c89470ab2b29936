"""Constraints a structured-output request may carry, for the seeded sweeps of the served
tests: 20 JSON schemas (nested objects, arrays, enums, bounded numbers, required and
optional fields, `$ref`), three regexes and an EBNF grammar, each with the check its answer
must pass. Every constraint bounds its answer's length, so a sampled answer (temperature
1.0) ends inside max_tokens and must parse."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"]}


def _object(properties: dict, required: list[str] | None = None, **more) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **more}


def _text(most: int, least: int = 0) -> dict:
    return {"type": "string", "minLength": least, "maxLength": most}


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


SCHEMAS: list[dict] = [
    PERSON,
    _object({"title": _text(8), "subtitle": _text(8), "count": _int(0, 9)}, required=["title"]),
    _object({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}),
    _object({"address": _object({"street": _text(10), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    _object({"tags": {"type": "array", "items": _text(6), "minItems": 1, "maxItems": 3}}),
    _object({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": _object({"id": _int(1, 99), "ok": {"type": "boolean"}})}}),
    {"$defs": {"point": POINT}, **_object({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})},
    _object({"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}}),
    _object({"price": {"type": "number", "minimum": 0, "maximum": 100}, "units": _int(1, 5)}),
    _object({"version": {"const": "v1"}, "value": _int(0, 5)}),
    _object({"user": _object({"profile": _object({"nick": _text(6, 1), "level": _int(1, 3)})})}),
    _object({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 3}}),
    _object({"value": {"anyOf": [_int(0, 9), _text(4)]}}),
    _object({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": _int(0, 9)}}}),
    _object({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _object({"word": _text(5, 2), "rank": _int(-50, 50)}),
    _object({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    {"$defs": {"person": PERSON}, **_object({"people": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/person"}}})},
    _object({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}, "d": _int(0, 3)}, required=["a"]),
    {"type": "array", "items": _int(0, 99), "minItems": 2, "maxItems": 4},
]
REGEXES = [r"[A-Z]{2}[0-9]{2}", r"(yes|no|maybe)", r"[0-9]{3}-[0-9]{4}"]
GRAMMAR = 'root ::= "(" num " " op " " num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "-" | "*"\n'
GRAMMAR_ANSWER = re.compile(r"\((?:[0-9]|[1-9][0-9]) [-+*] (?:[0-9]|[1-9][0-9])\)")


@dataclass(frozen=True)
class Case:
    """One constraint: its kind (json, regex, grammar), its text or schema, and its check."""

    kind: str
    spec: dict | str

    def check(self, answer: str) -> None:
        """Raises where `answer` does not parse or validate."""
        if self.kind == "json":
            jsonschema.validate(json.loads(answer), self.spec)
        elif self.kind == "regex":
            assert re.fullmatch(self.spec, answer), (self.spec, answer)
        else:
            assert GRAMMAR_ANSWER.fullmatch(answer), answer

    def vllm(self, old_keys: bool = False, compact: bool = False) -> dict:
        """As `llm`'s sampling parameters (vLLM's structured_outputs, or its older guided_* keys;
        `compact`: its disable_any_whitespace)."""
        if old_keys:
            return {f"guided_{self.kind}": self.spec}
        return {"structured_outputs": {self.kind: self.spec, **({"disable_any_whitespace": True} if compact else {})}}

    def trtllm(self) -> dict:
        """As TensorRT-LLM's guided_decoding inputs."""
        kind = {"json": "json_schema", "regex": "regex", "grammar": "ebnf_grammar"}[self.kind]
        return {"guided_decoding_guide_type": kind,
                "guided_decoding_guide": json.dumps(self.spec) if self.kind == "json" else self.spec}


CASES = [Case("json", s) for s in SCHEMAS] + [Case("regex", r) for r in REGEXES] + [Case("grammar", GRAMMAR)]
PREFIX = ("You write answers that a program reads. Reply with the value alone, no prose, no code fences. "
          "The reader is strict: it rejects anything that does not match the requested format exactly. ")
"""Shared by every prompt of a sweep: its full blocks are prefix-cache hits after the first."""


def prompt(index: int) -> str:
    return f"{PREFIX}Answer number {index}:"
