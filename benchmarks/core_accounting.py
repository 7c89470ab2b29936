"""Where the machine's cores went while a benchmark point ran: every thread's CPU time and
its time runnable but waiting for a core (Linux /proc schedstat), summed into the serving
path's parts by process and thread name.

Why: on a machine the client shares with the server, what a served point loses against the
offline engine is the question. If the engine's threads spend as much CPU per step served as
offline and the difference is time waiting for a core, the loss is the other parts' CPU and
nothing in the engine's own work; these readings show which.

Parts: `engine` (the engine thread and its OpenMP workers, `pagedserve-engi...` in a stub,
every thread of this process for the offline reference), `response thread` (the engine
model's, `pagedserve-resp...`), `stubs, other` (every other thread of tritonserver's python
stubs), `tritonserver`, `load generator` (this process, for a served point).
Linux only: elsewhere nothing is read and the report says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.client.process import proc_stat_fields

PROC = Path("/proc")
PARTS = ("engine", "response thread", "stubs, other", "tritonserver", "load generator")


@dataclass
class ThreadTime:
    """Seconds on a core and seconds runnable but waiting for one."""

    cpu_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class CoreUse:
    """One window's time per part (`PARTS`), and the window's wall time."""

    wall_s: float
    parts: dict[str, ThreadTime] = field(default_factory=dict)

    def cores(self, part: str) -> float:
        """The part's CPU over the window, in cores (1.0: one core all the time)."""
        return self.parts.get(part, ThreadTime()).cpu_s / self.wall_s if self.wall_s else 0.0

    def waiting_cores(self, part: str) -> float:
        """The part's threads' time runnable but off a core, in cores."""
        return self.parts.get(part, ThreadTime()).wait_s / self.wall_s if self.wall_s else 0.0

    def us_per(self, part: str, count: int) -> float | None:
        """The part's CPU per `count` (e.g. streamed responses), microseconds."""
        return self.parts.get(part, ThreadTime()).cpu_s / count * 1e6 if count else None


Reading = dict[tuple[int, int], tuple[str, ThreadTime]]
"""(pid, tid) -> (part, cumulative times)."""


class CoreWindow:
    """Read at `start()` and `stop()`; the difference is the window's CoreUse. `server_pid`:
    the tritonserver whose process tree (its python stubs are its children) is read; None: this
    process only, whose threads are then the part `own_part`."""

    def __init__(self, server_pid: int | None, own_part: str):
        self.server_pid, self.own_part = server_pid, own_part
        self.before: Reading = {}
        self.started = 0.0

    @staticmethod
    def supported() -> bool:
        return (PROC / "self" / "schedstat").exists()

    def start(self) -> None:
        self.before, self.started = self._read(), time.perf_counter()

    def stop(self) -> CoreUse:
        after, wall = self._read(), time.perf_counter() - self.started
        use = CoreUse(wall)
        for key, (part, times) in after.items():
            earlier = self.before.get(key, (part, ThreadTime()))[1]  # a thread born in the window: all of it
            total = use.parts.setdefault(part, ThreadTime())
            total.cpu_s += times.cpu_s - earlier.cpu_s
            total.wait_s += times.wait_s - earlier.wait_s
        return use

    def _read(self) -> Reading:
        reading: Reading = {}
        processes = {os.getpid(): self.own_part}
        if self.server_pid is not None:
            for pid in _process_tree(self.server_pid):
                processes[pid] = "stub" if _name(PROC / str(pid)).startswith("triton_python") else "tritonserver"
        for pid, role in processes.items():
            live = 0.0
            for tid, name, times in _threads(pid):
                reading[(pid, tid)] = (_part(role, name), times)
                live += times.cpu_s
            # threads that ended (a client's worker threads come and go): the process's total
            # keeps their CPU; their waits are lost with them
            reading[(pid, _ENDED)] = (_part(role, ""), ThreadTime(_process_cpu_s(pid) - live))
        return reading


_ENDED = -1
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> tuple[float, float] | None:
    """Seconds the machine's cores have been busy and idle since boot (/proc/stat), or None."""
    try:
        fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
    return (sum(ticks[:8]) - idle) / _TICKS, idle / _TICKS  # guest time is already in user


def busy_cores(seconds: float = 0.5) -> float | None:
    """How many cores were busy, on average, over the next `seconds` (None off Linux)."""
    before = _machine_busy_s()
    time.sleep(seconds)
    after = _machine_busy_s()
    if before is None or after is None:
        return None
    busy, idle = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / (busy + idle) if busy + idle > 0 else 0.0


def _process_cpu_s(pid: int) -> float:
    """A process's user + system CPU, ended threads included (clock ticks: 10 ms steps)."""
    fields = proc_stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS if fields else 0.0  # utime, stime
    except (ValueError, IndexError):
        return 0.0


def _part(role: str, thread_name: str) -> str:
    if role != "stub":
        return role
    if thread_name.startswith("pagedserve-engi"):
        return "engine"
    if thread_name.startswith("pagedserve-resp"):
        return "response thread"
    return "stubs, other"


def _process_tree(root: int) -> list[int]:
    """`root` and its descendants (tritonserver's stubs are its children)."""
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := proc_stat_fields(entry.name)):
            try:
                parents[int(entry.name)] = int(fields[1])  # ppid
            except (ValueError, IndexError):
                continue
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _name(path: Path) -> str:
    try:
        return (path / "comm").read_text().strip()
    except OSError:
        return ""


def _threads(pid: int) -> list[tuple[int, str, ThreadTime]]:
    threads = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return threads
    for task in tasks:
        try:
            cpu_ns, wait_ns = (task / "schedstat").read_text().split()[:2]
            name = _name(task)
        except (OSError, ValueError):
            continue  # the thread ended between the listing and the read
        threads.append((int(task.name), name, ThreadTime(int(cpu_ns) / 1e9, int(wait_ns) / 1e9)))
    return threads
