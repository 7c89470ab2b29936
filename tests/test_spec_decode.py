"""Speculative decoding without a model: the n-gram proposer against a brute-force oracle, the
`speculative_config` parser, and the scheduler's drafts, budget, rollback and prefix-cache
naming with the real BlockManager and a fake proposer."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pagedserve.backend.block_manager import BlockManager
from pagedserve.backend.config import EngineConfig
from pagedserve.backend.errors import ConfigError
from pagedserve.backend.model_runner import ModelRunner
from pagedserve.backend.sampler import Sampler
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.scheduler import Scheduler
from pagedserve.backend.sequence import FinishReason, Sequence
from pagedserve.backend.spec_decode import SpeculativeConfig, Speculator, parse, propose_ngram
from pagedserve.backend.spec_decode.draft_length import DraftLengths, StepCost
from pagedserve.backend.spec_decode.speculator import DraftRow


# -- n-gram proposer ------------------------------------------------------------
def oracle(tokens, min_n, max_n, k, max_len=None):
    """The longest n in [min_n, max_n] whose suffix occurs earlier, its earliest occurrence; the k after it."""
    total = len(tokens)
    if max_len is not None:
        k = min(k, max_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= total:
            continue
        suffix = tokens[total - n :]
        for start in range(0, total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_matches_the_brute_force_oracle_on_random_histories():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randrange(0, 30))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        max_len = rng.choice([None, len(tokens) + rng.randint(-1, 4)])
        assert propose_ngram(tokens, min_n, max_n, k, max_len) == oracle(tokens, min_n, max_n, k, max_len), (
            tokens, min_n, max_n, k, max_len)


def test_ngram_takes_the_longest_match_then_the_earliest_and_may_give_fewer_than_k():
    assert propose_ngram([1, 2, 9, 1, 2, 8, 2], 1, 3, 2) == [9, 1]  # "2" first at index 1
    assert propose_ngram([1, 2, 9, 5, 2, 8, 1, 2], 1, 3, 2) == [9, 5]  # "1 2" beats the later "2"
    assert propose_ngram([4, 5, 6, 4, 5], 2, 2, 5) == [6, 4, 5]  # runs into the suffix, ends at the tokens' end
    assert propose_ngram([1, 2, 3, 4], 1, 3, 3) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 1, 2], 3, 3, 3) == []  # shorter than prompt_lookup_min
    assert propose_ngram([7, 7, 7, 7, 7], 1, 2, 4, max_len=7) == [7, 7]  # max_model_len leaves room for two
    assert propose_ngram([7, 7, 7], 1, 2, 4) == [7]  # the earliest "7 7" has one token after it


# -- speculative_config -----------------------------------------------------------
def test_dict_json_and_key_value_forms_agree_with_vllm_defaults():
    expected = SpeculativeConfig("ngram", 3, 2, 4)
    as_dict = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert parse(as_dict) == expected
    assert parse(json.dumps(as_dict)) == expected
    assert parse("method=ngram, num_speculative_tokens=3,prompt_lookup_min=2,prompt_lookup_max=4") == expected
    assert EngineConfig(speculative_config=as_dict).speculative == expected
    assert EngineConfig.from_strings({"speculative_config": "method=ngram,num_speculative_tokens=3,"
                                                            "prompt_lookup_min=2,prompt_lookup_max=4"}).speculative == expected
    assert parse("num_speculative_tokens=2") == SpeculativeConfig("ngram", 2, 5, 5)  # vLLM: both unset -> 5, 5
    assert parse("num_speculative_tokens=2,prompt_lookup_max=3") == SpeculativeConfig("ngram", 2, 3, 3)
    assert parse("num_speculative_tokens=2,prompt_lookup_min=3") == SpeculativeConfig("ngram", 2, 3, 3)
    assert parse("") is None and parse({}) is None and EngineConfig().speculative is None
    assert parse("num_speculative_tokens=2,disable_by_batch_size=4").disable_by_batch_size == 4
    assert expected.draft_length == "adaptive"
    assert parse("num_speculative_tokens=2,draft_length=FIXED").draft_length == "fixed"
    draft = parse("model=/models/draft,num_speculative_tokens=3,draft_tensor_parallel_size=1,dtype=bfloat16")
    assert (draft.method, draft.model, draft.dtype) == ("draft_model", "/models/draft", "bfloat16")  # vLLM: a model means a draft


@pytest.mark.parametrize("value, match", [
    ("method=draft_model,num_speculative_tokens=3", "needs `model`"),
    ("method=ngram,model=/some/draft,num_speculative_tokens=3", "is for methods 'draft_model' and 'eagle3'"),
    ("model=/some/draft,num_speculative_tokens=3,draft_tensor_parallel_size=2", "draft_tensor_parallel_size must be 1"),
    ("model=/some/draft,num_speculative_tokens=3,dtype=int8", "dtype must be one of"),
    ("num_speculative_tokens=3,dtype=bfloat16", "dtype is the draft model's"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "needs `model`: the EAGLE-3 head"),
    ({"method": "mtp", "num_speculative_tokens": 3}, "not implemented yet"),
    ("method=magic,num_speculative_tokens=3", "method must be 'ngram', 'draft_model' or 'eagle3'"),
    ("method=ngram", "num_speculative_tokens is required"),
    ("num_speculative_tokens=0", "num_speculative_tokens must be >= 1"),
    ("num_speculative_tokens=two", "must be an integer"),
    ("num_speculative_tokens=2,prompt_lookup_min=4,prompt_lookup_max=2", "prompt_lookup_min .4. must be <="),
    ("num_speculative_tokens=2,prompt_lookup_min=0", "prompt_lookup_min must be >= 1"),
    ("num_speculative_tokens=2,lookahead=3", "unknown key.*lookahead"),
    ("num_speculative_tokens=2,disable_by_batch_size=0", "disable_by_batch_size must be >= 1"),
    ('{"num_speculative_tokens": 2', "not valid JSON"),
    ("num_speculative_tokens=2,draft_length=long", "draft_length must be one of"),
    ("num_speculative_tokens", "expected key=value"),
])
def test_bad_values_are_refused_naming_the_setting(value, match):
    with pytest.raises(ConfigError, match=match) as error:
        EngineConfig(speculative_config=value)
    assert error.value.field == "speculative_config"


def test_async_scheduling_on_and_several_ranks_are_refused_and_auto_async_is_off():
    from pagedserve.backend.engine import async_scheduling_wanted

    with pytest.raises(ConfigError, match="async_scheduling") as error:
        EngineConfig(speculative_config="num_speculative_tokens=2", async_scheduling="on")
    assert error.value.field == "speculative_config"
    with pytest.raises(ConfigError, match="tensor_parallel_size") as error:
        EngineConfig(speculative_config={"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 2},
                     tensor_parallel_size=2)
    assert error.value.field == "speculative_config"
    assert EngineConfig(speculative_config="num_speculative_tokens=2", tensor_parallel_size=2).speculative is not None
    config = EngineConfig(speculative_config="num_speculative_tokens=2")
    assert not async_scheduling_wanted(config, torch.device("cuda"))
    assert async_scheduling_wanted(EngineConfig(), torch.device("cuda"))


# -- which requests draft -----------------------------------------------------------
def test_a_verify_row_shows_the_processors_its_request_after_the_drafts_before_it():
    plain = Sequence("r", [1, 2], SamplingParams(temperature=0.0))
    assert DraftRow.of(plain, [7, 8]) is plain  # nothing reads its tokens: the request itself
    for params in (SamplingParams(temperature=0.0, repetition_penalty=1.1), SamplingParams(temperature=0.7, seed=3,
                   bad_words_ids=[[5]]), SamplingParams(temperature=0.0, min_tokens=4)):
        seq = Sequence("r", [1, 2], params)
        seq.append_token(3)
        assert DraftRow.of(seq, []) is seq  # its first row
        row = DraftRow.of(seq, [7, 8])
        assert (row.token_ids, row.output_token_ids, row.num_output_tokens) == ([1, 2, 3, 7, 8], [3, 7, 8], 3)
        assert row.params is params and row.generator is seq.generator and seq.token_ids == [1, 2, 3]
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0.0, min_tokens=1))
    seq.append_token(3)
    assert DraftRow.of(seq, [7]) is seq  # min_tokens met: no processor reads its tokens


# -- draft lengths: per request and by the measured cost of a row --------------------------------
def test_step_cost_is_each_sizes_recent_mean_stalls_damped_read_along_lines_between_sizes():
    cost = StepCost()
    cost.observe(8, 0.020)
    assert cost.at(8) == 0.020 and cost.at(9) is None  # one size: nothing between
    cost.observe(9, 0.030)  # a jump: past a kernel's few-row path
    cost.observe(40, 0.100)
    assert cost.at(9) == 0.030 and cost.at(24) == pytest.approx(0.030 + 0.070 * 15 / 31)
    assert cost.at(48) == pytest.approx(0.100 + 0.070 * 8 / 31)  # past the last: the last line on
    assert cost.at(7) == pytest.approx(0.010) and cost.at(2) == 0.0  # before the first: the first line back
    cost.observe(8, 0.010)
    assert cost.at(8) == pytest.approx(0.3 * 0.020 + 0.7 * 0.010)
    cost.observe(9, 0.070)  # a stall (a collection pause) more than doubles one step: a tenth of it counts
    assert cost.at(9) == pytest.approx(0.9 * 0.030 + 0.1 * 0.070)


def lengths_at(costs, k=4, adaptive=True):
    lengths = DraftLengths(k, adaptive)
    for tokens, seconds in costs.items():
        lengths.cost.observe(tokens, seconds)
    return lengths


def verify_n(lengths, seq, times, drafted, accepted):
    for _ in range(times):
        lengths.verified(seq, drafted, accepted)


def decoding(*names):
    return [greedy(name, 4) for name in names]


def test_cheap_rows_draft_everything_and_dear_rows_only_what_is_nearly_always_accepted():
    gpu = lengths_at({1: 0.010, 64: 0.011})  # 64 rows cost 10% more than one
    (chatting,) = decoding("chat")
    verify_n(gpu, chatting, 3, 4, 0)
    gpu.begin_step([chatting], [chatting])
    assert gpu.length(chatting) >= 2  # a seventh accepted still pays for its first rows at these prices
    verify_n(gpu, chatting, 20, 4, 0)
    gpu.begin_step([chatting], [chatting])
    assert gpu.length(chatting) == 0 and gpu.num_backed_off == 1  # nothing accepted in 20 verifies
    # a CPU: one more row past 8 leaves the few-row path (+10%), then each row ~1.9 ms
    cpu = lengths_at({1: 0.007, 5: 0.012, 8: 0.020, 9: 0.022, 40: 0.080})
    copying, chatting, *others = batch = decoding("copy", "chat", *"abcdef")
    verify_n(cpu, copying, 8, 4, 4)
    verify_n(cpu, chatting, 8, 4, 0)
    for seq in others:
        verify_n(cpu, seq, 8, 4, 1)
    cpu.begin_step([copying], [copying])
    assert cpu.length(copying) == 4  # alone: its rows nearly always pay
    cpu.begin_step(batch, batch)
    assert cpu.length(copying) == 4 and cpu.length(chatting) == 0 and [cpu.length(s) for s in others] == [0] * 6
    assert cpu.row_cost == pytest.approx(0.1)
    for seq in others:
        verify_n(cpu, seq, 8, 4, 0)
    verify_n(cpu, copying, 8, 4, 1)
    cpu.begin_step(batch, batch)
    assert [cpu.length(s) for s in batch] == [0] * 8  # nothing pays the jump past 8 rows
    fixed = lengths_at({1: 0.007, 5: 0.012}, adaptive=False)
    verify_n(fixed, chatting, 8, 4, 0)
    fixed.begin_step([chatting], [chatting])
    assert fixed.length(chatting) == 4


def test_a_draft_models_forwards_count_in_what_its_rows_cost():
    """The target's rows cost as on a GPU (64 rows 10% more than one). A draft whose forward costs
    a tenth of a target step drafts; one whose forward costs twice a target step does not, nor
    would a draft that is always accepted (so no shadow draft is worth its forward)."""
    (seq,) = decoding("a")
    for draft_seconds, drafts in ((0.001, True), (0.020, False)):
        lengths = DraftLengths(4, draft_model=True)
        for tokens, seconds in {1: 0.010, 64: 0.011}.items():
            lengths.cost.observe(tokens, seconds)
        verify_n(lengths, seq, 8, 4, 3)
        for tokens in (1, 8):
            lengths.observe_draft(tokens, draft_seconds)
        lengths.begin_step([seq], [seq])
        assert (lengths.length(seq), lengths.drafts_could_pay()) == ((4, True) if drafts else (0, False))


def test_before_two_sizes_are_measured_every_request_drafts_all_it_may_then_a_new_plain_size_is_measured():
    lengths = lengths_at({8: 0.020})
    batch = decoding(*"abcdefgh")
    for seq in batch:
        verify_n(lengths, seq, 8, 4, 0)
    lengths.begin_step(batch, batch)
    assert [lengths.length(s) for s in batch] == [4] * 8
    lengths.cost.observe(12, 0.030)  # two sizes now, neither of them a plain step of one
    alone = decoding("alone")  # the prior acceptance, one in two
    lengths.begin_step(alone, alone)
    assert lengths.length(alone[0]) == 0  # that plain step is measured first, not read off the line
    lengths.cost.observe(1, 0.015)
    lengths.begin_step(alone, alone)
    assert lengths.length(alone[0]) > 0


def test_a_held_back_request_drafts_again_once_its_shadow_drafts_would_have_been_accepted():
    lengths = lengths_at({1: 0.007, 5: 0.012})  # 1.25 ms a row
    (seq,) = decoding("a")
    verify_n(lengths, seq, 8, 4, 0)
    lengths.begin_step([seq], [seq])
    assert lengths.length(seq) == 0 and lengths.wants_shadow(seq)
    for _ in range(6):  # the request starts repeating its prompt: each shadow is what came
        lengths.shadow(seq, [5, 6, 7, 8])
        assert not lengths.wants_shadow(seq)
        for token in (5, 6, 7):
            seq.token_ids.append(token)
            lengths.begin_step([seq], [seq])
            assert not lengths.wants_shadow(seq)  # not all known, none wrong yet: still out
        seq.token_ids.append(8)
        lengths.begin_step([seq], [seq])
    assert lengths.length(seq) == 4
    lengths.shadow(seq, [1, 2, 3, 4])
    seq.token_ids.append(9)  # the first differs: scored at once (nothing would have been kept)
    lengths.begin_step([seq], [seq])
    assert lengths.wants_shadow(seq) and lengths._rate(seq) < 0.9
    lengths.shadow(seq, [1, 2])
    lengths.begin_step([], [])
    assert not lengths._acceptance and not lengths._shadows and lengths.length(seq) == 4  # not this step's


# -- scheduler with a fake proposer ---------------------------------------------------
class FakeSpeculator(Speculator):
    """Proposes `drafts[:cap]` for every eligible decode; records the caps asked."""

    def __init__(self, drafts):
        super().__init__(SpeculativeConfig("ngram", len(drafts), 1, 1))
        self.drafts = list(drafts)
        self.caps: list[int] = []

    def propose(self, seq, cap):
        self.caps.append(cap)
        return self.drafts[: max(0, min(cap, len(self.drafts)))]


def make(drafts, num_blocks=32, block_size=4, budget=64, max_model_len=None, caching=True):
    kv = BlockManager(num_blocks, block_size, caching)
    sched = Scheduler(kv, 8, budget, 16, max_model_len=max_model_len, eos_token_ids=[0], speculator=FakeSpeculator(drafts))
    return kv, sched


def greedy(name, n, max_tokens=16, start=10, temperature=0.0, **params):
    return Sequence(name, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, temperature=temperature, **params))


def prefill(sched, *seqs, token=99):
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert all(not d for d in batch.drafts)
    sched.update_from_output(batch, [token] * len(batch.sampling_seqs))


def test_a_decode_schedules_its_drafts_and_they_count_in_the_budget():
    kv, sched = make([1, 2, 3])
    a, b = greedy("a", 6), greedy("b", 5, start=40, temperature=0.8, max_tokens=2)  # b: no room left for drafts
    prefill(sched, a, b)
    batch = sched.schedule()
    assert batch.num_new_tokens == [4, 1] and batch.drafts == [[1, 2, 3], []]
    assert batch.samples == [True, True] and batch.sampling_seqs == [a, b]
    assert a.num_computed_tokens == 10 and len(a.block_table) == 3
    assert sched.max_num_batched_tokens - batch.num_tokens == 64 - 5


def test_no_request_drafts_while_more_than_disable_by_batch_size_run():
    kv, sched = make([1, 2, 3])
    sched.speculator.config = SpeculativeConfig("ngram", 3, 1, 1, disable_by_batch_size=1)
    a, b = greedy("a", 6), greedy("b", 5, start=40)
    prefill(sched, a, b)
    batch = sched.schedule()
    assert batch.drafts == [[], []] and batch.num_new_tokens == [1, 1]  # two running: over the limit
    sched.update_from_output(batch, [7, 8])
    sched.finish(b, FinishReason.ABORT)
    batch = sched.schedule()
    assert batch.drafts == [[1, 2, 3]]  # alone again: it drafts


def test_drafts_are_capped_by_the_budget_max_tokens_and_max_model_len():
    kv, sched = make([1, 2, 3, 4], budget=3)
    a = greedy("a", 2)
    prefill(sched, a)
    assert sched.schedule().num_new_tokens == [3]  # 1 + 2 drafts fill the budget of 3
    kv, sched = make([1, 2, 3, 4])
    a = greedy("a", 6, max_tokens=3)
    prefill(sched, a)  # 1 output: 2 more allowed, so 1 draft (accepted + the model's own = 2)
    batch = sched.schedule()
    assert batch.drafts == [[1]]
    sched.update_from_output(batch, [[1, 5]])
    assert a.output_token_ids == [99, 1, 5] and a.finish_reason is FinishReason.LENGTH
    kv, sched = make([1, 2, 3, 4], max_model_len=9)
    a = greedy("a", 6)
    prefill(sched, a)  # 7 tokens of 9: one draft, one token of the model's
    assert sched.schedule().drafts == [[1]]


def test_drafts_are_dropped_never_preempting_anyone_when_blocks_are_short():
    kv, sched = make([1, 2, 3], num_blocks=4, block_size=4)
    a, b = greedy("a", 6), greedy("b", 7, start=40)
    prefill(sched, a, b)  # a: 7 tokens in 2 blocks, b: 8 tokens in 2; none free
    batch = sched.schedule()  # a's drafts need a third block: dropped; both decode their own token
    assert batch.num_preempted == 0 and sched.num_preemptions == 0
    assert batch.drafts == [[], []] and batch.num_new_tokens == [1, 1]
    kv, sched = make([1, 2, 3], num_blocks=5, block_size=4)
    a, b = greedy("a", 6), greedy("b", 7, start=40)
    prefill(sched, a, b)  # one block free: a's drafts take it, b's find none
    batch = sched.schedule()
    assert batch.num_preempted == 0 and batch.drafts == [[1, 2, 3], []] and batch.num_new_tokens == [4, 1]
    kv, sched = make([1, 2, 3], num_blocks=5, block_size=4)
    a, b = greedy("a", 6), greedy("b", 8, start=40)
    prefill(sched, a, b)  # one block free, which b's own next token (position 8) needs: a may not draft into it
    batch = sched.schedule()
    assert batch.num_preempted == 0 and batch.drafts == [[], [1, 2, 3]] and len(b.block_table) == 3  # b: its new block holds them


def test_rejected_drafts_roll_back_and_free_the_tail_blocks_in_a_new_table():
    kv, sched = make([1, 2, 3, 4, 5], block_size=4)
    a = greedy("a", 6)
    prefill(sched, a)  # 7 tokens, 6 computed, 2 blocks
    free_before = kv.num_free_blocks
    batch = sched.schedule()
    assert a.num_computed_tokens == 12 and len(a.block_table) == 3
    table = a.block_table
    sched.update_from_output(batch, [[1, 50]])  # draft 1 accepted, 2 rejected: 50 is the model's own
    assert a.output_token_ids == [99, 1, 50]
    assert a.num_computed_tokens == 8 and a.num_tokens == 9  # 99 and 1 computed, 50 not yet
    assert len(a.block_table) == 2 and a.block_table is not table and kv.num_free_blocks == free_before
    assert sched.generation_tokens_total == 3


def test_a_block_completed_by_the_models_own_token_is_not_named_until_its_kv_is_computed():
    kv, sched = make([1, 2, 3], block_size=4)
    a = greedy("a", 6)
    prefill(sched, a)  # token 99 at position 6
    batch = sched.schedule()  # drafts at positions 7, 8, 9
    sched.update_from_output(batch, [[77]])  # all rejected: 77 at position 7, whose slot holds draft 1's K/V
    assert a.token_ids[4:8] == [14, 15, 99, 77] and a.num_computed_tokens == 7
    block = kv.blocks[a.block_table[1]]
    assert block.block_hash is None and a.num_named_blocks == 1
    batch = sched.schedule()  # 77 computed now (with drafts after it)
    assert batch.num_new_tokens == [4]
    sched.update_from_output(batch, [[1, 2, 3, 60]])  # all accepted, plus the bonus token
    assert block.block_hash is not None and a.num_named_blocks == 2  # positions 8-11: 1 2 3 computed, 60 not
    assert a.num_computed_tokens == 11 and a.output_token_ids == [99, 77, 1, 2, 3, 60]
    assert kv.blocks[a.block_table[2]].block_hash is None


def test_a_stop_token_or_a_stop_string_inside_an_accepted_run_drops_the_rest():
    kv, sched = make([1, 2, 3])
    a, b = greedy("a", 6), greedy("b", 6, start=40)
    prefill(sched, a, b)
    batch = sched.schedule()
    stops = iter([False, True])  # b: a stop string in its text at its second token of the step
    sched.update_from_output(batch, [[1, 0, 3, 4], [1, 2, 3, 5]],
                             on_token=lambda s: s is b and next(stops))
    assert a.output_token_ids == [99, 1, 0] and a.finish_reason is FinishReason.STOP  # EOS 0
    assert b.output_token_ids == [99, 1, 2] and b.finish_reason is FinishReason.STOP
    assert kv.num_free_blocks == kv.num_blocks and not sched.has_unfinished()


def test_a_seq_at_its_limit_or_not_decoding_gets_no_drafts():
    kv, sched = make([1, 2, 3], budget=16)
    a = greedy("a", 30)
    sched.add(a)
    batch = sched.schedule()  # a prefill chunk: no drafts
    assert batch.drafts == [[]] and batch.num_new_tokens == [16]
    kv, sched = make([1, 2, 3])
    a = greedy("a", 6, max_tokens=2)
    prefill(sched, a)  # 1 of 2 outputs: no room for a draft
    assert sched.schedule().drafts == [[]]


# -- the runner's inputs and the verifier ---------------------------------------------------
def test_plan_feeds_the_last_token_then_the_drafts_and_asks_logits_at_each():
    kv, sched = make([1, 2, 3])
    a, b = greedy("a", 6), greedy("b", 5, start=40, temperature=0.8, max_tokens=2)  # b: no room left for drafts
    c = greedy("c", 9, start=60)
    prefill(sched, a, b)
    sched.add(c)
    batch = sched.schedule()  # a: 1 + 3 drafts; b: 1; c: its 9-token prompt
    runner = object.__new__(ModelRunner)
    runner.block_size, runner.lora, runner.last_rows, runner.images = 4, None, {}, None
    arrays = runner.plan(batch)
    assert arrays.input_ids[:5].tolist() == [99, 1, 2, 3, 99]
    assert arrays.input_ids[5:].tolist() == list(range(60, 69))
    assert arrays.positions[:4].tolist() == [6, 7, 8, 9]
    assert arrays.logits_indices.tolist() == [0, 1, 2, 3, 4, 13]
    assert [s.request_id for s in arrays.sampling_seqs] == ["a", "b", "c"]
    slots = [a.block_table[p // 4] * 4 + p % 4 for p in range(6, 10)]
    assert arrays.slots[:4].tolist() == slots


def test_verify_takes_every_greedy_row_by_first_max():
    sampler = Sampler([0], 0, torch.device("cpu"))
    a, b = greedy("a", 3), greedy("b", 3)
    logits = torch.zeros(5, 8)
    logits[0, 3] = logits[1, 4] = logits[2, 5] = logits[3, 6] = 1.0
    logits[4, 2] = logits[4, 7] = 2.0  # a tie: the first maximum wins
    verification = Speculator.verify(logits, [a, b], [[4, 9, 6], []], sampler)
    rows, firsts = verification.tokens, verification.firsts
    assert rows.tolist() == [3, 4, 5, 6, 2] and firsts.tolist() == [3, 2]
    assert verification.generator_states == [None, None]
    speculator = Speculator(SpeculativeConfig("ngram", 3, 1, 1))
    emitted = speculator.accept(rows.tolist(), [[4, 9, 6], []], [a, b])
    assert emitted == [[3], [2]]
    emitted = speculator.accept([3, 4, 5, 6, 2], [[3, 4, 9], []], [a, b])
    assert emitted == [[3, 4, 5], [2]]
    stats = speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert np.all(np.diff(stats.accepted_per_pos) <= 0)


# -- Triton metrics ------------------------------------------------------------------------
def test_triton_metrics_count_up_vllms_spec_decode_families():
    from pagedserve.backend.outputs import EngineStats
    from pagedserve.backend.triton_adapter.metrics import EngineMetrics

    from .triton_adapter.fakes import FakePbUtils, MetricFamily

    labels = {"model": "llm", "version": "1"}
    assert EngineMetrics(FakePbUtils(), labels, vllm=True).spec_decode is None
    assert EngineMetrics(FakePbUtils(), labels, vllm=False, num_speculative_tokens=3).spec_decode is None
    metrics = EngineMetrics(FakePbUtils(), labels, vllm=True, num_speculative_tokens=3)
    families = {f.name: f.kind for f in metrics.families}
    names = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert all(families[name] == MetricFamily.COUNTER for name in names)

    def stats(drafts, tokens, accepted, per_pos, backed_off=0, share=0.0):
        return EngineStats(0, 0, 0, 10, 0, 10, 0.0, 0.0, 0, 0, 0, spec_num_drafts=drafts, spec_num_draft_tokens=tokens,
                           spec_num_accepted_tokens=accepted, spec_accepted_per_pos=per_pos,
                           spec_num_backed_off=backed_off, spec_row_cost=share)

    spec = metrics.spec_decode
    assert spec is not None
    metrics.refresh(stats(2, 5, 3, [2, 1, 0]))
    metrics.refresh(stats(3, 8, 6, [3, 2, 1]))
    assert [c.total for c in spec.counters.values()] == [3, 8, 6]
    assert {p: m.total for p, m in spec.per_pos.items()} == {"0": 3, "1": 2, "2": 1}
    assert spec.per_pos["1"].labels == {**labels, "position": "1"}
    # the draft lengths' back-off: pagedserve's own families, with or without vLLM's
    for vllm in (True, False):
        metrics = EngineMetrics(FakePbUtils(), labels, vllm=vllm, num_speculative_tokens=3)
        metrics.refresh(stats(1, 1, 1, [1, 0, 0], backed_off=4, share=0.25))
        metrics.refresh(stats(1, 1, 1, [1, 0, 0], backed_off=9, share=0.7))
        assert metrics.spec_backed_off is not None and metrics.spec_backed_off.total == 9
        assert metrics.spec_row_cost is not None and metrics.spec_row_cost.total == 0.7
    assert EngineMetrics(FakePbUtils(), labels, vllm=True).spec_backed_off is None
