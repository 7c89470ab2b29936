"""The watcher thread outlives failing ticks; recently cancelled ids expire and stay bounded."""

from __future__ import annotations

import threading

from pagedserve.backend.triton_adapter.cancellation import AskRotation, RecentIds, Watcher, asked_cancelled

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


def test_every_request_is_asked_in_turn_a_few_per_tick():
    """32 requests, 8 asks a tick: each asked once in 4 ticks; a new request is asked at its
    first tick, a finished one no more."""
    asks = AskRotation(per_tick=8)
    ids = [f"r{i}" for i in range(32)]
    asked = [asks.pick(ids) for _ in range(4)]
    assert all(len(tick) == 8 for tick in asked) and sorted(sum(asked, [])) == sorted(ids)
    assert "new" in asks.pick(ids[1:] + ["new"])
    assert all("r0" not in asks.pick(ids[1:]) for _ in range(8))
    assert asks.pick(["a", "b"]) == ["a", "b"]  # fewer than a tick's budget: all of them, every tick
    assert asks.pick(["a", "b"]) == ["a", "b"]
