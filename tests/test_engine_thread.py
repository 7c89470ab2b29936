"""EngineThread: concurrent submissions stream back; aborts and shutdown free everything."""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedserve.backend import EngineDeadError, SamplingParams
from pagedserve.backend.engine_thread import EngineThread

from .conftest import GPU_SHARE, assert_engine_idle

pytestmark = pytest.mark.slow


@pytest.fixture
def loop(engine):
    thread = EngineThread(lambda: engine)
    yield thread
    thread.shutdown()
    assert_engine_idle(engine)


def test_concurrent_streams_match_offline_generation(engine, loop):
    prompts = [engine.encode(f"Fact number {i} about the moon:") for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0)
    results: dict[int, str] = {}

    def client(i):
        results[i] = "".join(out.text for out in loop.stream(f"c{i}", prompts[i], params))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    loop.shutdown()
    offline = engine.generate(prompts, params, use_tqdm=False)
    assert [results[i] for i in range(6)] == [c.text for c in offline]


def test_abort_ends_the_stream_and_frees_blocks_within_a_step(engine, loop):
    outputs: queue.Queue = queue.Queue()
    loop.submit("long", engine.encode("Count to a thousand:"), SamplingParams(max_tokens=500, ignore_eos=True), outputs.put)
    first = outputs.get(timeout=30)
    assert not first.finished
    loop.abort("long")
    while not (out := outputs.get(timeout=30)).finished:
        pass
    assert out.finish_reason == "abort"


def test_shutdown_finishes_every_request(engine):
    loop = EngineThread(lambda: engine)
    outputs: queue.Queue = queue.Queue()
    loop.submit("a", engine.encode("Hello"), SamplingParams(max_tokens=400, ignore_eos=True), outputs.put)
    loop.shutdown()
    finals = []
    while not outputs.empty():
        finals.append(outputs.get())
    assert finals and finals[-1].finished
    with pytest.raises(EngineDeadError):
        loop.submit("b", [1, 2], SamplingParams(), outputs.put)
    assert_engine_idle(engine)


def test_a_failing_step_errors_the_requests_in_it_then_the_engine_serves_the_next(engine, monkeypatch):
    loop = EngineThread(lambda: engine)
    execute = engine.runner.execute
    calls = {"n": 0}

    def fails_on_the_third_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", fails_on_the_third_step)
    first, second = queue.Queue(), queue.Queue()
    loop.submit("z", engine.encode("Hi"), SamplingParams(max_tokens=50, ignore_eos=True), first.put)
    loop.submit("w", engine.encode("Hello there"), SamplingParams(max_tokens=50, ignore_eos=True), second.put)
    for outputs in (first, second):
        while not (final := outputs.get(timeout=60)).finished:
            pass
        assert final.finish_reason == "error" and "device lost" in final.error and "retry" in final.error
    assert engine.block_manager.num_used_blocks == 0 and engine.stats().num_recoveries == 1
    assert loop.is_alive
    after = list(loop.stream("next", engine.encode("Hi"), SamplingParams(max_tokens=4, temperature=0)))
    assert after[-1].finished and after[-1].error is None
    assert "".join(o.text for o in after) == engine.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].text
    loop.shutdown()
    assert_engine_idle(engine)


def test_a_failing_recovery_errors_every_request_and_refuses_new_ones(engine, monkeypatch):
    loop = EngineThread(lambda: engine)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    monkeypatch.setattr(engine, "recover_from_failure", broken)
    outputs: queue.Queue = queue.Queue()
    loop.submit("z", engine.encode("Hi"), SamplingParams(max_tokens=4), outputs.put)
    final = outputs.get(timeout=30)
    assert final.finished and "device lost" in final.error
    loop._thread.join(10)
    assert not loop.is_alive
    with pytest.raises(EngineDeadError, match="device lost"):
        loop.submit("y", [1, 2], SamplingParams(), outputs.put)
    monkeypatch.undo()
    for request_id in list(engine.scheduler.requests):  # the dead loop left its request behind
        engine.abort(request_id)
    assert_engine_idle(engine)


def test_engine_is_built_on_its_own_thread_and_build_errors_reach_the_caller(small_llama):
    """Load and steps share one OS thread (one OpenMP team: engine_thread.py says why it
    matters for speed); a failing build raises in the caller, not in a dead thread."""
    from pagedserve.backend import LLMEngine

    built_on: list[str] = []

    def make() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE)

    loop = EngineThread(make)
    try:
        assert built_on == ["pagedserve-engine"]
        if sys.platform.startswith("linux"):  # `top -H` and /proc show it by name (its OpenMP workers inherit it)
            assert Path(f"/proc/self/task/{loop._thread.native_id}/comm").read_text().strip() == "pagedserve-engi"
        assert list(loop.stream("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0)))[-1].finished
    finally:
        loop.shutdown()

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineThread(broken)


def test_a_request_submitted_while_the_engine_dies_gets_its_final(engine, monkeypatch):
    """The double fault: a submit that passed the dead-engine check while the recovery was
    failing used to land in an inbox nobody would read again (no response, ever). Now the
    check and the death share one lock: the request is refused or failed, never lost."""
    loop = EngineThread(lambda: engine)
    b_checking, failed = threading.Event(), threading.Event()

    def broken_step(*args, **kwargs):
        raise RuntimeError("device lost")

    def broken_recovery():
        b_checking.wait(5)  # the racing submit is past its checks
        raise RuntimeError("device lost")

    admit = engine.check_admission

    def racing_admission(ids, params, arriving=0):
        if ids == [7, 8, 9]:
            b_checking.set()
            failed.wait(2)  # the old code failed the inbox meanwhile
        return admit(ids, params, arriving)

    fail_inbox = loop._fail_inbox

    def recording_fail_inbox(error):
        fail_inbox(error)
        failed.set()

    monkeypatch.setattr(engine.runner, "execute", broken_step)
    monkeypatch.setattr(engine, "recover_from_failure", broken_recovery)
    monkeypatch.setattr(engine, "check_admission", racing_admission)
    monkeypatch.setattr(loop, "_fail_inbox", recording_fail_inbox)
    outputs: queue.Queue = queue.Queue()
    loop.submit("a", engine.encode("Hi"), SamplingParams(max_tokens=4), outputs.put)
    racer: queue.Queue = queue.Queue()

    def submit_b():
        try:
            loop.submit("b", [7, 8, 9], SamplingParams(max_tokens=4), racer.put)
        except EngineDeadError as error:
            racer.put(error)

    threading.Thread(target=submit_b).start()
    assert outputs.get(timeout=30).finished
    final = racer.get(timeout=30)
    assert isinstance(final, EngineDeadError) or (final.finished and "device lost" in final.error)
    loop._thread.join(10)
    monkeypatch.undo()
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    assert_engine_idle(engine)


def test_a_hung_step_fails_its_requests_refuses_new_ones_and_recovers_when_it_returns(engine, monkeypatch):
    """A step stuck past step_timeout_s (a device or kernel that never answers): the watchdog
    gives its requests an error final, the engine says it is not ready and refuses new work;
    once the step returns, the engine is rebuilt and serves again with every block free."""
    loop = EngineThread(lambda: engine, step_timeout_s=0.3)
    release, stuck = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def hangs_once(*args, **kwargs):
        if not release.is_set():
            stuck.set()
            release.wait(30)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", hangs_once)
    try:
        outputs: queue.Queue = queue.Queue()
        loop.submit("h", engine.encode("Hello"), SamplingParams(max_tokens=8), outputs.put)
        assert stuck.wait(30)
        final = outputs.get(timeout=10)
        assert final.finished and "step_timeout_s" in final.error
        assert not loop.is_ready and loop.is_alive and loop.num_hangs == 1
        with pytest.raises(EngineDeadError, match="hung"):
            loop.submit("refused", [1, 2], SamplingParams(), outputs.put)
        assert outputs.empty()  # the hung step's late outputs never follow the error final
        release.set()
        deadline = time.monotonic() + 30
        while not loop.is_ready and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loop.is_ready
        assert list(loop.stream("after", engine.encode("Hi"), SamplingParams(max_tokens=4, temperature=0)))[-1].finish_reason == "length"
        assert outputs.empty()
    finally:
        release.set()
        loop.shutdown()
    assert_engine_idle(engine)


def test_no_watchdog_without_a_step_timeout(engine):
    loop = EngineThread(lambda: engine)
    try:
        assert loop.is_ready and not hasattr(loop, "_watchdog")
    finally:
        loop.shutdown()
    assert not loop.is_ready  # shut down: not serving


def test_a_grammar_compiling_holds_up_neither_other_submits_nor_running_streams(engine, loop, monkeypatch):
    """A new schema compiles in its submitter's thread before the inbox lock: another
    client's submit is admitted at once, and a running stream keeps streaming."""
    prepare = type(engine.grammars).prepare
    compiling = threading.Event()

    def slow_prepare(compiler, constraint):
        if constraint.compiled is None:
            compiling.set()
            time.sleep(1.5)
        prepare(compiler, constraint)

    monkeypatch.setattr(type(engine.grammars), "prepare", slow_prepare)
    running: queue.Queue = queue.Queue()
    loop.submit("running", engine.encode("Count to a hundred:"), SamplingParams(max_tokens=400, ignore_eos=True), running.put)
    running.get(timeout=30)
    constrained = SamplingParams.from_dict({"max_tokens": 4, "guided_regex": "[a-z]{4}"})
    outputs: queue.Queue = queue.Queue()
    submitter = threading.Thread(target=loop.submit, args=("schema", engine.encode("Hi"), constrained, outputs.put))
    submitter.start()
    assert compiling.wait(10)
    start = time.monotonic()
    loop.submit("plain", engine.encode("Hello"), SamplingParams(max_tokens=2), outputs.put)
    admitted = time.monotonic() - start
    streamed = [running.get(timeout=30) for _ in range(3)]  # while the compile sleeps
    assert admitted < 0.5 and submitter.is_alive() and len(streamed) == 3
    submitter.join(10)
    loop.abort("running")
