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
import math
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Container, Iterable

logger = logging.getLogger("pagedserve")

WATCH_INTERVAL_S = 0.1
"""How often both decoupled models ask Triton whether their requests were cancelled. Each
ask is a round trip to the server per request, made under the lock the response thread
sends under, so asks are rationed per tick (`AskRotation`)."""
MIN_ASKS_PER_TICK = 8
"""Asked every tick whatever the asks cost, so every request is asked in turn however slow
the server is (the rotation before the time budget: a cancelled request stopped within
0.1 s x ceil(requests / 8))."""
ASK_BUDGET_S = 0.02
"""Past MIN_ASKS_PER_TICK, a tick asks until it has spent this long (a fifth of the
interval) in round trips: at a full queue (64 running, 1,024 waiting) the old fixed 8 asks a
tick noticed a disconnect only after many seconds (benchmarks/RESULTS.md, "Cancellation
noticed at a full queue")."""
GENERATING_EVERY_S = 0.5
"""A request that is generating (it costs engine steps) and was not asked for this long goes
before every waiting one."""


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
    """Which requests a watcher tick asks about, and asks them: generating requests not asked
    for GENERATING_EVERY_S first, then everyone asked longest ago (or never) first; at least
    `min_per_tick` a tick, then more until the tick has spent `budget_s` asking. So a generating
    request is noticed within about half a second, and every waiting one in turn, as fast as the
    server answers."""

    def __init__(self, min_per_tick: int = MIN_ASKS_PER_TICK, budget_s: float = ASK_BUDGET_S,
                 clock: Callable[[], float] = time.monotonic):
        self.min_per_tick, self.budget_s, self.clock = min_per_tick, budget_s, clock
        self.asked_at: dict[str, float] = {}

    def ask(self, request_ids: Iterable[str], is_cancelled: Callable[[str], bool],
            generating: Container[str] = ()) -> list[str]:
        """Ask `is_cancelled(request_id)` of as many as this tick affords; the cancelled ones."""
        start = self.clock()
        self.asked_at = {request_id: self.asked_at.get(request_id, -math.inf) for request_id in request_ids}
        overdue = start - GENERATING_EVERY_S
        order = sorted(self.asked_at, key=lambda r: (not (r in generating and self.asked_at[r] <= overdue),
                                                      self.asked_at[r]))
        cancelled = []
        for count, request_id in enumerate(order):
            now = self.clock()
            if count >= self.min_per_tick and now - start >= self.budget_s:
                break
            self.asked_at[request_id] = now
            if is_cancelled(request_id):
                cancelled.append(request_id)
        return cancelled


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
