"""Tensor parallelism (backend/distributed/, backend/models/parallel.py): tensor_parallel_size=2
gives greedy tokens identical to 1 in every batch regime (3 likewise on the bundled model);
a killed worker fails its step's requests with an error naming it and the workers restart
(or, if that fails, requests are refused); a hung worker times out; shutting down,
cancelling, or rank 0 dying leaves no worker process. Token identity is exact, and
tensor_parallel_checks.py says why it can be (greedy_margins)."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from pagedserve.backend import ConfigError, EngineConfig, EngineDeadError, LLMEngine, SamplingParams
from pagedserve.backend.distributed import group
from pagedserve.backend.engine_thread import EngineThread

from .conftest import assert_engine_idle
from .test_cuda_graphs import oracle_drafts
from .test_spec_decode_draft import first_layer_draft  # noqa: F401 - a fixture
from .tensor_parallel_checks import greedy_margins, worker_processes, write_small_llama

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(small_llama):
    """A tensor_parallel_size 1 and 2 engine per regime's settings, built on first use."""
    built: dict[tuple, LLMEngine] = {}

    def get(tp: int, **settings) -> LLMEngine:
        key = (tp, *sorted(settings.items()))
        if key not in built:
            built[key] = LLMEngine(model=small_llama, dtype="float32", tensor_parallel_size=tp, **settings)
        return built[key]

    yield get
    pids = {p.pid for engine in built.values() if engine.workers for p in engine.workers.processes}
    for engine in built.values():
        engine.close()
    assert not pids & {p.pid for p in worker_processes()}


@pytest.fixture
def new_workers():
    """Worker processes of this test process that were not running when the test began
    (the module's shared engines keep theirs)."""
    before = {p.pid for p in worker_processes()}
    return lambda: [p for p in worker_processes() if p.pid not in before]


def run_both(engines, prompts, max_tokens, **settings):
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    one, two = engines(1, **settings), engines(2, **settings)
    results = [engine.generate(prompts, params, use_tqdm=False) for engine in (one, two)]
    assert [r.token_ids for r in results[1]] == [r.token_ids for r in results[0]]
    assert_engine_idle(two)
    return one, two, results[1]


def test_plain_batch_is_token_identical_and_the_margins_say_why(engines, small_prompts):
    one, two, results = run_both(engines, small_prompts, [24, 16, 20, 12, 28])
    assert len(two.workers.processes) == 1 and two.runner.kv_caches[0].key.shape[2] == 1  # 1 of 2 KV heads here
    sequences = [(p + r.token_ids, len(r.token_ids)) for p, r in zip(small_prompts, results)]
    difference, lead = greedy_margins(one, two, sequences)
    assert 0 < difference < 1e-4  # sharding only reorders float32 sums
    assert lead > 2 * difference  # so the greedy choice is the same on both, at every position


def test_chunked_prefill_is_token_identical(engines, small_prompts):
    run_both(engines, small_prompts, [24, 16, 20, 12, 28], max_num_batched_tokens=16)


def test_shared_prefix_is_token_identical_and_hits_the_cache(engines, small_prompts, sentencepiece_tokenizer):
    prefix = small_prompts[2][:64]
    shared = [prefix + sentencepiece_tokenizer.encode(f" Question {i}: what next?") for i in range(4)]
    _, two, results = run_both(engines, shared, [12, 16, 8, 20])
    assert max(r.num_cached_tokens for r in results) >= 48


def test_preemption_under_a_tiny_kv_cache_is_token_identical(engines, small_prompts):
    # 16 blocks of 16 = 256 slots for 270 prompt tokens and 168 generated: the scheduler must preempt
    _, two, _ = run_both(engines, small_prompts[::-1], [40, 24, 40, 24, 40], num_kv_blocks=16)
    assert two.stats().num_preemptions > 0


def test_speculation_on_two_ranks_gives_the_tokens_of_one_rank_without_it(engines, small_prompts, small_llama,
                                                                        first_layer_draft):
    """n-gram (drafts from the tokens one rank gives, accepted and rejected: a random model repeats
    nothing for the lookup to find) and a draft model on rank 0 drafting for the two-rank target:
    every verify step's rows go to both ranks, and the tokens are one rank's without speculation."""
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (24, 16, 20, 12, 28)]
    expected = [r.token_ids for r in engines(1).generate(small_prompts, params, use_tqdm=False)]
    ngram = "method=ngram,num_speculative_tokens=3,draft_length=fixed"
    for spec in (ngram, {"method": "draft_model", "model": first_layer_draft, "num_speculative_tokens": 3,
                         "draft_length": "fixed"}):
        two = LLMEngine(model=small_llama, dtype="float32", tensor_parallel_size=2, speculative_config=spec)
        try:
            if spec is ngram:
                oracle_drafts(two, small_prompts, expected)
            assert [r.token_ids for r in two.generate(small_prompts, params, use_tqdm=False)] == expected
            assert two.stats().spec_num_accepted_tokens > 0
            assert_engine_idle(two)
        finally:
            two.close()


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path, sentencepiece_tokenizer, small_prompts, new_workers):
    path = write_small_llama(tmp_path, sentencepiece_tokenizer, num_kv_heads=1, tie_word_embeddings=True)
    params = SamplingParams(max_tokens=16, **GREEDY)
    results = []
    for tp in (1, 2):
        engine = LLMEngine(model=path, dtype="float32", tensor_parallel_size=tp)
        results.append([c.token_ids for c in engine.generate(small_prompts, params, use_tqdm=False)])
        engine.close()
    assert results[0] == results[1]
    assert not new_workers()


@pytest.mark.parametrize("family", ["phi3", "gemma3", "qwen3-moe", "gpt-oss", "gpt-oss-mxfp4"])
def test_families_that_stack_or_sandwich_their_projections_split_across_ranks(family, tmp_path, sentencepiece_tokenizer,
                                                                                small_prompts, new_workers):
    """Phi-3's stacked q/k/v and gate/up (read as their parts, then sharded as Llama's), Gemma 3's
    per-head q/k norms, norms around each sublayer and sliding-window layers (a window of 16), and
    Qwen3-MoE's experts (each expert's width split, the router on every rank), gpt-oss's sinks (split
    with their heads), biased attention and experts (the output projections' biases added by rank 0
    alone), its MXFP4 experts (codes and scales split with the weights' rows and columns): 2 ranks
    give 1 rank's tokens."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from .test_gpt_oss import write_mxfp4_release
    from .test_models import make_biases_and_norms_matter

    from .tensor_parallel_checks import SMALL_LLAMA

    torch.manual_seed(0)
    shape = dict(SMALL_LLAMA, num_key_value_heads=2, vocab_size=-(-len(sentencepiece_tokenizer) // 64) * 64,
                 pad_token_id=None)
    if family == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**shape))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, head_dim=16, sliding_window=16,
                                                   layer_types=["sliding_attention", "full_attention"]))
    elif family.startswith("gpt-oss"):
        model = make_biases_and_norms_matter(GptOssForCausalLM(GptOssConfig(
            **{**shape, "initializer_range": 0.1}, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"])), "gpt-oss")
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   norm_topk_prob=True))
    path = str(tmp_path)
    if family == "gpt-oss-mxfp4":  # its release's MXFP4 experts: codes and scales split as the weights
        path = write_mxfp4_release(model, tmp_path, sentencepiece_tokenizer)
    else:
        model.save_pretrained(tmp_path)
        sentencepiece_tokenizer.save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=12, **GREEDY)
    results = []
    for tp in (1, 2):
        engine = LLMEngine(model=path, dtype="float32", tensor_parallel_size=tp)
        results.append([c.token_ids for c in engine.generate(small_prompts, params, use_tqdm=False)])
        engine.close()
    assert results[0] == results[1]
    assert not new_workers()


def test_the_bundled_model_on_3_ranks_is_token_identical_and_still_answers_paris(engine, prompts, new_workers):
    """Real weights: SmolLM2's 9 heads and 3 KV heads split 3 ways (1 KV head per rank)."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    three = LLMEngine(dtype="float32", tensor_parallel_size=3)
    try:
        results = three.generate(prompts[:3], params, use_tqdm=False)
        assert [r.token_ids for r in results] == [r.token_ids for r in engine.generate(prompts[:3], params, use_tqdm=False)]
        assert results[0].text == "The capital of France is Paris."
        difference, lead = greedy_margins(engine, three, [(p + r.token_ids, len(r.token_ids)) for p, r in zip(prompts, results)])
        assert lead > 2 * difference
    finally:
        three.close()
    assert not new_workers()


def test_tensor_parallel_size_is_parsed_and_checked_like_every_setting():
    assert EngineConfig().tensor_parallel_size == 1
    assert EngineConfig.from_strings({"tensor_parallel_size": "2"}).tensor_parallel_size == 2
    for value, hint in (("0", ">= 1"), ("two", "expected int")):
        with pytest.raises(ConfigError, match=hint) as info:
            EngineConfig.from_strings({"tensor_parallel_size": value})
        assert info.value.field == "tensor_parallel_size"


def test_sizes_and_settings_it_cannot_split_are_refused_before_any_worker_starts(small_llama, model_path, new_workers):
    with pytest.raises(ConfigError, match=r"9 attention heads is not a multiple of 2.*use one of \[1, 3\]") as info:
        LLMEngine(model=model_path, tensor_parallel_size=2)  # the bundled SmolLM2: 9 heads, 3 KV heads
    assert info.value.field == "tensor_parallel_size"
    with pytest.raises(ConfigError, match="4 attention heads is not a multiple of 3"):
        LLMEngine(model=small_llama, tensor_parallel_size=3)
    for setting in ({"quantization": "fp8"}, {"quantization": "int4"}, {"kv_cache_dtype": "fp8"}):
        with pytest.raises(ConfigError, match=f"{next(iter(setting))}=.*tensor_parallel_size=1") as info:
            LLMEngine(model=small_llama, tensor_parallel_size=2, **setting)
        assert info.value.field == "tensor_parallel_size"
    assert not new_workers()


# -- worker death, shutdown, cancellation ------------------------------------------------
def submit_all(loop: EngineThread, prompts, max_tokens: int) -> queue.Queue:
    outputs: queue.Queue = queue.Queue()
    for i, prompt in enumerate(prompts):
        loop.submit(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), outputs.put)
    return outputs


def finals(outputs: queue.Queue, count: int, timeout: float = 60) -> dict[str, object]:
    """The final output of each of `count` requests (within `timeout` s in all: no hang)."""
    deadline, done = time.monotonic() + timeout, {}
    while len(done) < count:
        output = outputs.get(timeout=max(0.1, deadline - time.monotonic()))
        if output.finished:
            done[output.request_id] = output
    return done


@pytest.fixture
def tp2_loop(small_llama, new_workers):
    """A tensor_parallel_size 2 engine driven by an EngineThread; shut down after the test
    (also when it failed), and then none of its workers may remain."""
    loop = EngineThread(lambda: LLMEngine(model=small_llama, dtype="float32", tensor_parallel_size=2))
    yield loop
    loop.shutdown()
    assert not new_workers()


def tokens(outputs) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def test_a_killed_worker_fails_its_requests_by_name_and_the_workers_restart(tp2_loop, engines, small_prompts, new_workers):
    engine = tp2_loop.engine
    outputs = submit_all(tp2_loop, small_prompts, max_tokens=300)
    first = outputs.get(timeout=30)
    assert not first.finished and first.error is None
    victim = engine.workers.processes[0]
    os.kill(victim.pid, signal.SIGKILL)

    failed = finals(outputs, len(small_prompts))
    assert all(o.finish_reason == "error" for o in failed.values())
    for output in failed.values():
        assert f"tensor-parallel worker rank 1 (pid {victim.pid}) died: killed by SIGKILL (exit code -9)" in output.error
        assert "retrying it may succeed" in output.error

    # served once the workers are restarted (the engine thread does that right after failing the requests)
    params = SamplingParams(max_tokens=8, **GREEDY)
    served = [tokens(tp2_loop.stream(f"after{i}", p, params)) for i, p in enumerate(small_prompts[:2])]
    assert served == [c.token_ids for c in engines(1).generate(small_prompts[:2], params, use_tqdm=False)]
    assert engine.num_recoveries == 1
    (worker,) = new_workers()
    assert worker.pid != victim.pid and engine.workers.processes[0].pid == worker.pid


def test_when_the_restart_fails_too_new_requests_are_refused_clearly(tp2_loop, small_prompts, tmp_path):
    tp2_loop.engine.workers.spec.model_path = str(tmp_path / "gone")  # new workers will fail to load
    outputs = submit_all(tp2_loop, small_prompts[:2], max_tokens=300)
    outputs.get(timeout=30)
    os.kill(tp2_loop.engine.workers.processes[0].pid, signal.SIGKILL)
    failed = finals(outputs, 2)
    assert all("rank 1" in o.error and "SIGKILL" in o.error for o in failed.values())
    deadline = time.monotonic() + 30
    while tp2_loop.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(EngineDeadError, match=r"engine failed earlier .*tensor-parallel worker rank 1 .*died: exit code 1"):
        tp2_loop.submit("late", small_prompts[0], SamplingParams(max_tokens=4), lambda output: None)


def test_a_hung_worker_times_out_instead_of_hanging_the_engine(tp2_loop, small_prompts, monkeypatch):
    # rank 0's wait per collective, before any step (one already waiting keeps the timeout it began with)
    monkeypatch.setattr(group, "STEP_TIMEOUT", datetime.timedelta(seconds=3))
    outputs = submit_all(tp2_loop, small_prompts[:2], max_tokens=300)
    outputs.get(timeout=30)
    hung = tp2_loop.engine.workers.processes[0]
    os.kill(hung.pid, signal.SIGSTOP)
    failed = finals(outputs, 2, timeout=30)
    assert all("every worker is still running (one hung?)" in o.error and "Timed out" in o.error for o in failed.values())
    served = list(tp2_loop.stream("after", small_prompts[0], SamplingParams(max_tokens=4, **GREEDY)))
    assert served[-1].error is None and hung.poll() == -signal.SIGKILL  # replaced: killed, not left stopped


def test_shutdown_with_requests_in_flight_leaves_no_worker(tp2_loop, small_prompts, new_workers):
    assert len(new_workers()) == 1
    outputs = submit_all(tp2_loop, small_prompts, max_tokens=300)
    outputs.get(timeout=30)
    tp2_loop.shutdown()
    assert len(finals(outputs, len(small_prompts), timeout=5)) == len(small_prompts)
    assert not new_workers()


def test_cancelled_requests_then_shutdown_leave_no_worker(tp2_loop, small_prompts, new_workers):
    outputs = submit_all(tp2_loop, small_prompts, max_tokens=300)
    outputs.get(timeout=30)
    for i in range(len(small_prompts)):
        tp2_loop.abort(f"r{i}")
    assert {o.finish_reason for o in finals(outputs, len(small_prompts)).values()} == {"abort"}
    assert_engine_idle(tp2_loop.engine)
    assert len(new_workers()) == 1  # cancelling ends requests, not workers
    tp2_loop.shutdown()
    assert not new_workers()


def test_workers_exit_when_rank_0_dies(small_llama):
    script = textwrap.dedent(f"""
        import time
        from pagedserve.backend import LLMEngine
        engine = LLMEngine(model={small_llama!r}, dtype="float32", tensor_parallel_size=2)
        print("ready", flush=True)
        time.sleep(600)
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout.readline().strip() == "ready"
        (worker,) = worker_processes(psutil.Process(rank0.pid))
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 10
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, "the worker outlived rank 0"
    finally:
        rank0.kill()
        rank0.wait()
