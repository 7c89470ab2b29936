"""Sampler: each parameter's effect on the distribution, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.backend.sampler import Sampler, first_max_index
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.sequence import Sequence

EOS = 0
VOCAB = 8


def seq(params, prompt=(1, 2), output=(), name="r"):
    s = Sequence(name, list(prompt), params)
    for t in output:
        s.append_token(t)
    if params.seed is not None:
        s.generator = torch.Generator().manual_seed(params.seed)
    return s


def sampler(seed=0):
    return Sampler([EOS], seed=seed, device=torch.device("cpu"))


def draws(params, logits, n=400, **kw):
    s = sampler()
    rows = [seq(params, **kw) for _ in range(n)]
    return s(logits.expand(n, -1).clone(), rows).token_ids


LOGITS = torch.tensor([[0.0, 3.0, 2.5, 2.0, 1.0, 0.5, -1.0, -2.0]])


def test_greedy_is_the_argmax():
    assert sampler()(LOGITS.clone(), [seq(SamplingParams(temperature=0))]).token_ids == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_takes_the_first_of_tied_maxima_as_argmax(dtype):
    """Greedy output must not change with the reduction torch uses: ties (common in
    bfloat16 logits) and NaN/inf rows pick what argmax picks."""
    g = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (64, 49152), generator=g).to(dtype)
    assert torch.equal(first_max_index(ties), ties.argmax(dim=-1))
    odd = torch.zeros(3, 100, dtype=dtype)
    odd[0, 5], odd[0, 9], odd[1, 7], odd[1, 9] = float("nan"), 1.0, float("inf"), float("inf")
    assert torch.equal(first_max_index(odd), odd.argmax(dim=-1))


def test_top_k_keeps_only_the_k_most_likely():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2), LOGITS)) == {1, 2}


def test_top_p_keeps_the_nucleus():
    probs = LOGITS.softmax(-1)[0]
    # tokens 1 and 2 hold < 0.8 together, so token 3 joins; token 4 never does
    assert probs[1] + probs[2] < 0.8 < probs[1] + probs[2] + probs[3]
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.8), LOGITS)) == {1, 2, 3}


def test_min_p_drops_tokens_far_below_the_best():
    # p(token)/p(best) = exp(logit - 3): token 3 has exp(-1)=0.37, token 4 exp(-2)=0.14
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3), LOGITS)) == {1, 2, 3}


def test_low_temperature_sharpens_and_sampling_follows_probabilities():
    sharp = draws(SamplingParams(temperature=0.05), LOGITS)
    assert sharp.count(1) == len(sharp)
    flat = draws(SamplingParams(temperature=1.0), LOGITS, n=4000)
    expected = LOGITS.softmax(-1)[0, 1].item()
    assert abs(flat.count(1) / len(flat) - expected) < 0.03


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [sampler(seed=1)(LOGITS.clone(), [seq(params)]).token_ids[0] for _ in range(1)]
    s = sampler(seed=99)
    mates = [seq(SamplingParams(temperature=1.0)) for _ in range(5)]
    target = seq(params)
    batch = s(LOGITS.expand(6, -1).clone(), mates[:3] + [target] + mates[3:]).token_ids
    assert batch[3] == alone[0]
    seeded = seq(SamplingParams(temperature=1.0, seed=1234))
    again = sampler()
    runs = [again(LOGITS.clone(), [seeded]).token_ids[0] for _ in range(20)]
    fresh = seq(SamplingParams(temperature=1.0, seed=1234))
    assert [again(LOGITS.clone(), [fresh]).token_ids[0] for _ in range(20)] == runs
    assert len(set(runs)) > 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = sampler()
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = s.apply_processors(LOGITS.clone(), [seq(params, prompt=(1,), output=(6,))])
    assert out[0, 1] == pytest.approx(1.5) and out[0, 6] == pytest.approx(-2.0)
    assert out[0, 2] == LOGITS[0, 2]
    assert s(LOGITS.clone(), [seq(params, prompt=(1,), output=(6,))]).token_ids == [2]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    out = sampler().apply_processors(LOGITS.clone(), [seq(params, prompt=(2,), output=(1, 1, 3))])
    assert out[0, 1] == pytest.approx(3.0 - 0.5 - 0.5)
    assert out[0, 3] == pytest.approx(2.0 - 0.5 - 0.25)
    assert out[0, 2] == pytest.approx(2.5)  # prompt tokens are not penalized


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    s = sampler()
    assert s(logits.clone(), [seq(params, output=(5,))]).token_ids == [1]
    assert s(logits.clone(), [seq(params, output=(5, 5))]).token_ids == [0]


def test_bad_words_are_never_generated():
    params = SamplingParams(temperature=0, bad_words_ids=[[1], [4, 2]])
    s = sampler()
    assert s(LOGITS.clone(), [seq(params)]).token_ids == [2]
    assert s(LOGITS.clone(), [seq(params, output=(4,))]).token_ids == [3]  # 2 would complete "4 2"


def test_logprobs_are_the_raw_distribution_with_top_alternatives():
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    out = sampler()(LOGITS.clone(), [seq(params, prompt=(1,))])
    logprob = out.logprobs[0]
    reference = LOGITS.log_softmax(-1)[0]
    assert logprob.token_id == out.token_ids[0]
    assert logprob.logprob == pytest.approx(reference[logprob.token_id].item())
    assert [t for t, _ in logprob.top] == [1, 2, 3]
    assert logprob.top[0][1] == pytest.approx(reference[1].item())
    assert all(math.isfinite(v) for _, v in logprob.top)


def test_no_logprobs_unless_asked():
    assert sampler()(LOGITS.clone(), [seq(SamplingParams(temperature=0))]).logprobs == [None]
