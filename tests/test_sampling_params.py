"""SamplingParams: invalid values are rejected naming the field; JSON strings are cast."""

import pytest

from pagedserve.backend.errors import InvalidRequestError
from pagedserve.backend.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("seed", -1),
        ("min_tokens", -1),
        ("stream_interval", 0),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=f"'{field}'") as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_from_dict_casts_strings_like_the_triton_vllm_backend():
    p = SamplingParams.from_dict(
        {"max_tokens": "1500", "temperature": "0", "top_p": "0.9", "ignore_eos": "true", "stop": "END", "seed": "7"}
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.ignore_eos, p.stop, p.seed) == (1500, 0.0, 0.9, True, ["END"], 7)
    assert p.greedy


def test_from_dict_rejects_unknown_keys_and_bad_types():
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter") as info:
        SamplingParams.from_dict({"temprature": 0.5})
    assert info.value.field == "temprature"
    with pytest.raises(InvalidRequestError, match="'max_tokens': expected int"):
        SamplingParams.from_dict({"max_tokens": "many"})
    with pytest.raises(InvalidRequestError, match="'max_tokens'"):
        SamplingParams.from_dict({"max_tokens": 2.5})
    with pytest.raises(InvalidRequestError, match="'stop_token_ids'"):
        SamplingParams.from_dict({"stop_token_ids": 5})


def test_vocabulary_bounds_are_checked():
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).check_vocab(8)


def test_vllm_keys_are_accepted_at_their_neutral_values():
    params = SamplingParams.from_dict({
        "best_of": "1", "use_beam_search": False, "length_penalty": 1.0, "early_stopping": "false",
        "detokenize": True, "spaces_between_special_tokens": True, "output_kind": "DELTA", "logit_bias": {},
        "max_tokens": 5,
    })
    assert params.max_tokens == 5


@pytest.mark.parametrize("key, value, says", [
    ("best_of", 3, "best_of"), ("use_beam_search", True, "beam search"),
    ("allowed_token_ids", [1], "allowed_token_ids"), ("logit_bias", {"5": 10}, "logit_bias"),
    ("prompt_logprobs", 1, "prompt logprobs"),
])
def test_vllm_keys_we_cannot_honour_are_refused_naming_the_key(key, value, says):
    with pytest.raises(InvalidRequestError, match=rf"'{key}'.*{says}"):
        SamplingParams.from_dict({key: value})


def test_bad_words_is_a_known_key():
    assert SamplingParams.from_dict({"bad_words": ["foo", "bar"]}).bad_words == ["foo", "bar"]


def test_n_is_a_number_of_samples_within_bounds():
    assert SamplingParams.from_dict({"n": "3"}).n == 3
    with pytest.raises(InvalidRequestError, match="'n'"):
        SamplingParams(n=0)
