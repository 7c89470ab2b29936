"""Structured outputs: every constrained request's text follows its grammar (JSON schemas,
any JSON object, regexes, EBNF, choices), sampled at temperature 1.0 on the bundled model,
also with n > 1 and prefix hits; a grammar that does not compile is refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve.backend import InvalidRequestError, SamplingParams
from pagedserve.backend.structured_output import StructuredOutputs

from .conftest import assert_engine_idle

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["city", "point"], "additionalProperties": False},
    {"$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}}, "type": "object",
     "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}, "note": {"type": "string", "maxLength": 10}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}, "label": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["score", "label"], "additionalProperties": False},
]
PROMPT = "Answer in JSON. Describe something you like:"


def test_request_keys_in_vllms_words_old_and_new():
    assert StructuredOutputs.from_request({"structured_outputs": {"regex": "a+"}}) == StructuredOutputs("regex", "a+")
    assert StructuredOutputs.from_request({"guided_choice": ["x", "y"]}).spec == '["x", "y"]'
    assert StructuredOutputs.from_request({"guided_json": {"type": "object"}}).kind == "json"
    assert StructuredOutputs.from_request({"structured_outputs": {"json_object": True}}).kind == "json_object"
    params = SamplingParams.from_dict({"guided_decoding": {"grammar": 'root ::= "a"', "backend": "xgrammar"}})
    assert params.structured_outputs.kind == "grammar" and params.needs_host_tokens
    assert SamplingParams.from_dict({"guided_regex": "b", "guided_decoding_backend": "auto"}).structured_outputs.spec == "b"
    assert SamplingParams.from_dict({"max_tokens": 3}).structured_outputs is None


@pytest.mark.parametrize("values, field", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"structured_outputs": {"ebnf": "x"}}, "structured_outputs"),
    ({"guided_choice": []}, "structured_outputs.choice"),
    ({"guided_choice": "yes"}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "structured_outputs.json"),
    ({"guided_regex": ""}, "structured_outputs.regex"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_malformed_constraints_are_refused_naming_the_field(values, field):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams.from_dict(values)
    assert refused.value.field == field


@pytest.mark.parametrize("values, field", [
    ({"guided_regex": "[a-"}, "structured_outputs.regex"),
    ({"guided_json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"guided_grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_a_grammar_that_does_not_compile_is_refused_at_admission(engine, values, field):
    with pytest.raises(InvalidRequestError) as refused:
        engine.check_admission(engine.encode("Hi"), SamplingParams.from_dict({"max_tokens": 4, **values}))
    assert refused.value.field == field and "does not compile" in str(refused.value)
    assert "/project/" not in str(refused.value)  # xgrammar's source location is left out
    assert_engine_idle(engine)


def test_sampled_json_always_parses_and_validates(engine):
    """Every schema four times at temperature 1.0 (seeded), batched with the others, each
    prompt twice (the second a prefix hit): 100% valid."""
    prompt = engine.encode(PROMPT)
    params = [SamplingParams.from_dict({"max_tokens": 160, "temperature": 1.0, "seed": 10 * i + k,
                                        "structured_outputs": {"json": schema}})
              for i, schema in enumerate(SCHEMAS) for k in range(4)]
    outputs = engine.generate([prompt] * len(params), params, use_tqdm=False)
    for output, p in zip(outputs, params):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), json.loads(p.structured_outputs.spec))
    assert_engine_idle(engine)


def test_regex_choice_grammar_and_any_json_object(engine):
    prompt = engine.encode("Write something:")
    cases = [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"guided_grammar": 'root ::= "(" [a-c]{1,3} ")"'}, lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"json": SCHEMAS[3], "disable_any_whitespace": True}},  # vLLM's: one form, no blank runs
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3]) is None and "\n" not in t and "  " not in t),
    ]
    params = [SamplingParams.from_dict({"max_tokens": 200, "temperature": 1.0, "seed": s, **c})
              for c, _ in cases for s in range(3)]
    outputs = engine.generate([prompt] * len(params), params, use_tqdm=False)
    for j, output in enumerate(outputs):
        check = cases[j // 3][1]
        assert output.finish_reason == "stop" and check(output.text), (j, output.text)
    assert_engine_idle(engine)


def test_n_samples_each_follow_the_grammar_and_ignore_eos_ends_where_it_is_complete(engine):
    prompt = engine.encode("Pick:")
    params = SamplingParams.from_dict({"n": 3, "max_tokens": 20, "temperature": 1.0, "seed": 7, "ignore_eos": True,
                                       "guided_choice": ["alpha", "beta", "gamma"]})
    output, = engine.generate([prompt], params, use_tqdm=False)
    texts = [sample.text for sample in output.samples] if output.samples else [output.text]
    assert len(texts) == 3 and all(t in ("alpha", "beta", "gamma") for t in texts), texts
    assert_engine_idle(engine)


def test_structural_tags_in_both_forms_compile_and_bad_ones_are_refused(engine):
    legacy = {"type": "structural_tag", "triggers": ["<call>"],
              "structures": [{"begin": "<call>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}},
                              "end": "</call>"}]}
    current = {"type": "structural_tag", "format": {"type": "tag", "begin": "<b>", "content": {"type": "json_schema",
               "json_schema": {"type": "integer"}}, "end": "</b>"}}
    for tag in (legacy, current):
        engine.check_admission(engine.encode("Hi"), SamplingParams.from_dict({"structured_outputs": {"structural_tag": tag}}))
    with pytest.raises(InvalidRequestError) as refused:
        engine.check_admission(engine.encode("Hi"), SamplingParams.from_dict(
            {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}}))
    assert refused.value.field == "structured_outputs.structural_tag"
    assert_engine_idle(engine)


def test_masking_only_broken_draws_changes_no_answer(engine, monkeypatch):
    """Rows without top-k, top-p or min-p are masked only where their draw breaks the grammar
    (backend/sampler.py): the same seeded and greedy tokens as masking every row first, with
    fewer rows masked than tokens drawn."""
    from pagedserve.backend import sampler

    prompt = engine.encode(PROMPT)
    params = [SamplingParams.from_dict({"max_tokens": 96, "temperature": t, "seed": 5 + k, "structured_outputs": {"json": schema}})
              for schema in SCHEMAS[:3] for k, t in enumerate((1.0, 0.7, 0.0))]
    masked_rows = []
    mask = sampler.mask_logits
    monkeypatch.setattr(sampler, "mask_logits", lambda logits, rows, matchers: (masked_rows.append(len(rows)), mask(logits, rows, matchers)))
    late = engine.generate([prompt] * len(params), params, use_tqdm=False)
    late_masked = sum(masked_rows)
    monkeypatch.setattr(sampler, "masks_late", lambda p: False)
    first = engine.generate([prompt] * len(params), params, use_tqdm=False)
    assert [o.token_ids for o in late] == [o.token_ids for o in first]
    drawn = sum(len(o.token_ids) for o in late)
    assert sum(masked_rows) - late_masked == drawn and late_masked < drawn, (late_masked, drawn)
    assert_engine_idle(engine)


def test_preempted_constrained_requests_resume_their_grammar(engine):
    """A KV cache too small for the batch preempts requests mid-answer (recomputed later): each
    matcher keeps the state of the tokens kept, so every answer still validates, and the
    greedy ones equal those of the roomy engine."""
    from pagedserve.backend import LLMEngine

    prompt = engine.encode(PROMPT + " " + "Use many fields and long values. " * 6)
    params = [SamplingParams.from_dict({"max_tokens": 120, "temperature": t, "seed": k,
                                        "structured_outputs": {"json": SCHEMAS[k % 3]}}) for k, t in enumerate((0.0, 1.0) * 4)]
    small = LLMEngine(dtype="float32", num_kv_blocks=20, max_num_seqs=8)  # 320 slots for 8 x (~70 + up to 120) tokens
    squeezed = small.generate([prompt] * len(params), params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    for output, p in zip(squeezed, params):
        jsonschema.validate(json.loads(output.text), json.loads(p.structured_outputs.spec))
    roomy = engine.generate([prompt] * len(params), params, use_tqdm=False)
    assert [o.token_ids for o in squeezed[::2]] == [o.token_ids for o in roomy[::2]]
    assert_engine_idle(small)


def test_a_grammar_with_stop_strings_logprobs_and_top_p(engine):
    """A constrained request also honours its stop string (the text ends before it), returns
    logprobs of the model's raw distribution for every token, and with top-p (masked before
    its draw) still follows the grammar."""
    prompt = engine.encode("Write a code:")
    params = [SamplingParams.from_dict({"max_tokens": 40, "temperature": 1.0, "seed": s, "logprobs": 2, "stop": ["-"],
                                        "guided_regex": r"[0-9]{3}-[a-z]{2,4}", **extra})
              for s, extra in enumerate(({}, {"top_p": 0.9}, {"top_k": 5}))]
    for output in engine.generate([prompt] * len(params), params, use_tqdm=False):
        assert output.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", output.text), output.text
        assert len(output.logprobs) == len(output.token_ids) and all(len(lp.top) == 2 for lp in output.logprobs)
        assert all(lp.logprob <= 0.0 and lp.rank >= 1 for lp in output.logprobs)
    assert_engine_idle(engine)
