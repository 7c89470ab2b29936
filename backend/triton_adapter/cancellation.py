"""Plumbing both decoupled models use to turn client cancellation into aborts.

- `Watcher`: a thread that runs a tick every few milliseconds; an exception in
  one tick is logged and the next tick runs, so one failure never ends
  cancellation for good.
- `RecentIds`: ids cancelled before their request arrived. A relay sends the cancel
  and the request to the engine's model as two BLS calls, and the cancel can win the
  race; the request is then refused on arrival instead of running to max_tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

logger = logging.getLogger("pagedserve")

WATCH_INTERVAL_S = 0.1
"""How often both decoupled models ask Triton whether their requests were cancelled. Each
ask is a round trip to the server per request: every 20 ms at 32 requests that was ~6% of a
core in each model on a 2-core machine."""
ASKS_PER_TICK = 8
"""At most this many requests asked a tick (`AskRotation`): every 0.1 s at 32 requests the asks
kept the watcher in round trips 15% of the time, holding up responses (the server answers
them and the sends on one queue; 2-core Zen 4, bf16). A cancelled request stops within
WATCH_INTERVAL_S x ceil(requests / ASKS_PER_TICK) (0.1 s up to 8 requests, 0.4 s at 32) plus
one engine step."""


class Throttle:
    """True at most once every `every_s` seconds: for logging a failure that may repeat every tick."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.next = every_s, 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.every_s
        return True


_ASK_LOG = Throttle()


class AskRotation:
    """Which requests a watcher tick asks about: at most `per_tick`, those asked longest ago
    (or never) first, so every request in flight is asked in turn."""

    def __init__(self, per_tick: int = ASKS_PER_TICK):
        self.per_tick = per_tick
        self.ticks = 0
        self.asked_at: dict[str, int] = {}

    def pick(self, request_ids: Iterable[str]) -> list[str]:
        self.ticks += 1
        self.asked_at = {request_id: self.asked_at.get(request_id, 0) for request_id in request_ids}
        chosen = sorted(self.asked_at, key=self.asked_at.__getitem__)[: self.per_tick]
        for request_id in chosen:
            self.asked_at[request_id] = self.ticks
        return chosen


class Watcher:
    """Runs `tick()` every `interval_s` on a daemon thread until `stop()`."""

    def __init__(self, name: str, tick: Callable[[], None], interval_s: float):
        self.tick, self.interval_s = tick, interval_s
        self.stopping = threading.Event()
        self.may_log = Throttle()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            try:
                self.tick()
            except Exception:
                if self.may_log():
                    logger.exception("%s: tick failed (it runs again)", self.thread.name)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping.set()
        self.thread.join(timeout)


def asked_cancelled(response_sender: Any) -> bool:
    """`response_sender.is_cancelled()`, False (logged now and then) when asking failed,
    so one broken sender does not stop the watcher from asking the others."""
    try:
        return bool(response_sender.is_cancelled())
    except Exception:
        if _ASK_LOG():
            logger.exception("asking whether a request was cancelled failed")
        return False


class RecentIds:
    """Ids remembered for `ttl_s` seconds (at most `limit` of them, oldest dropped first)."""

    def __init__(self, ttl_s: float = 30.0, limit: int = 4096):
        self.ttl_s, self.limit = ttl_s, limit
        self.expiry: OrderedDict[str, float] = OrderedDict()
        self.lock = threading.Lock()

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.expiry[request_id] = now + self.ttl_s
            self.expiry.move_to_end(request_id)
            while self.expiry and (len(self.expiry) > self.limit or next(iter(self.expiry.values())) < now):
                self.expiry.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """True (and forgotten) if `request_id` was added within the last `ttl_s` seconds."""
        with self.lock:
            expiry = self.expiry.pop(request_id, None)
        return expiry is not None and expiry >= time.monotonic()
