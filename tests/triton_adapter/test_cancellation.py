"""The watcher thread outlives failing ticks; recently cancelled ids expire and stay bounded."""

from __future__ import annotations

import math
import threading

from pagedserve.backend.triton_adapter.cancellation import WATCH_INTERVAL_S, AskRotation, RecentIds, Watcher, asked_cancelled

from .fakes import wait_until


def test_a_failing_tick_does_not_end_the_watcher():
    ticks = []

    def tick():
        ticks.append(1)
        if len(ticks) < 3:
            raise RuntimeError("boom")

    watcher = Watcher("test-watcher", tick, 0.001)
    try:
        wait_until(lambda: len(ticks) >= 5)
        assert watcher.is_alive()
    finally:
        watcher.stop()
    assert not watcher.is_alive()


def test_asking_a_broken_sender_is_not_cancelled():
    class Broken:
        def is_cancelled(self):
            raise RuntimeError("stub gone")

    assert asked_cancelled(Broken()) is False


def test_recent_ids_are_taken_once_expire_and_stay_bounded():
    ids = RecentIds(ttl_s=0.05, limit=2)
    ids.add("a")
    assert ids.take("a") and not ids.take("a")
    ids.add("old")
    threading.Event().wait(0.1)
    assert not ids.take("old")  # expired
    for name in ("x", "y", "z"):
        ids.add(name)
    assert not ids.take("x") and ids.take("y") and ids.take("z")  # the oldest went first


class FakeServer:
    """Ticks every 0.1 s on a fake clock; each ask costs `ask_s` of it. Which requests were cancelled when."""

    def __init__(self, ask_s: float):
        self.now, self.ask_s = 0.0, ask_s
        self.cancelled_at: dict[str, float] = {}
        self.asks = AskRotation(clock=lambda: self.now)

    def is_cancelled(self, request_id: str) -> bool:
        self.now += self.ask_s
        return self.cancelled_at.get(request_id, math.inf) <= self.now

    def time_to_notice(self, request_ids: list[str], generating: set[str], target: str, at: float) -> float:
        """Tick (the watcher's interval apart) until `target`, cancelled at `at`, is noticed."""
        self.cancelled_at[target] = at
        tick = 0
        while True:
            self.now = max(self.now, tick * WATCH_INTERVAL_S)
            if target in self.asks.ask(request_ids, self.is_cancelled, generating):
                return self.now - at
            tick += 1
            assert tick < 10_000


FULL_QUEUE = [f"r{i}" for i in range(64 + 1024)]
RUNNING = set(FULL_QUEUE[:64])


def test_at_a_full_queue_a_generating_request_is_noticed_within_a_second_however_slow_the_asks():
    """64 generating and 1,024 waiting: asks that take 0.5 ms (a loaded 2-core machine) still
    reach every generating request twice a second; the waiting ones follow in turn."""
    server = FakeServer(ask_s=0.0005)
    assert server.time_to_notice(FULL_QUEUE, RUNNING, "r40", at=2.03) <= 0.65
    assert server.time_to_notice(FULL_QUEUE, RUNNING, "r7", at=3.51) <= 0.65
    assert server.time_to_notice(FULL_QUEUE, RUNNING, "r900", at=4.2) <= 5.0  # 1,024 at ~27 a tick


def test_fast_asks_notice_any_request_within_a_second_at_a_full_queue():
    server = FakeServer(ask_s=0.00003)
    assert server.time_to_notice(FULL_QUEUE, RUNNING, "r1000", at=1.05) <= 1.0
    assert server.time_to_notice(FULL_QUEUE, RUNNING, "r3", at=2.77) <= 1.0


def test_every_request_is_asked_in_turn_at_least_a_few_per_tick():
    """Asks slower than the tick's budget: still 8 a tick, each request once in 4 ticks at 32; a
    new request is asked at its first tick, a finished one no more."""
    server = FakeServer(ask_s=0.05)
    asked: list[str] = []
    ids = [f"r{i}" for i in range(32)]

    def record(request_id: str) -> bool:
        asked.append(request_id)
        return server.is_cancelled(request_id)

    for _ in range(4):
        server.asks.ask(ids, record)
    assert len(asked) == 32 and sorted(asked) == sorted(ids)
    asked.clear()
    server.asks.ask(ids[1:] + ["new"], record)
    assert "new" in asked
    for _ in range(8):
        server.asks.ask(ids[1:], record)
    assert "r0" not in asked
    asked.clear()
    server.asks.ask(["a", "b"], record)
    server.asks.ask(["a", "b"], record)
    assert asked == ["a", "b", "a", "b"]  # fewer than a tick's minimum: all of them, every tick
