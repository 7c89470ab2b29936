"""Run a server as a subprocess and stop it without leaving anything behind.

Both servers we start, ``tritonserver`` (client/triton_server.py) and the naive
baseline (benchmarks/serving.py), need the same care: output appended to a log file
that explains a failed start, readiness polled while watching for an early exit, and
a stop that takes the whole process group (a server's helper processes included), so
its ports are free when :meth:`ServerProcess.stop` returns.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["ServerProcess", "ServerProcessError", "free_port", "group_command_lines", "http_status", "proc_stat_fields"]


class ServerProcessError(RuntimeError):
    """A server process could not be started, did not become ready, or would not stop."""


def proc_stat_fields(pid: int | str) -> list[str] | None:
    """The fields of Linux /proc/<pid>/stat after the command name: state, ppid, pgrp, ...,
    utime, stime at 0, 1, 2, ..., 11, 12 (the name may hold spaces and parentheses, so the
    split is at the last ")"); None when the process is gone or the file is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def group_command_lines(pgid: int) -> dict[int, list[str]]:
    """pid -> command line (its NUL-split fields) of each live process in process group
    `pgid` (Linux ``/proc``; empty elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    lines = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = proc_stat_fields(entry)
            if fields is None or int(fields[2]) != pgid:  # pgrp
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                lines[int(entry)] = [arg.decode(errors="replace") for arg in f.read().split(b"\0")]
        except (OSError, ValueError, IndexError):
            continue
    return lines


def free_port(exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port that is free right now (the OS picks it; another process may still race us)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port
    raise ServerProcessError("could not find a free TCP port")


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class ServerProcess:
    """One server process in its own session (so its own process group), stdout and
    stderr appended to ``log_file``.

    ``name`` starts every error message; errors are raised as ``error`` (a
    :class:`ServerProcessError` subclass of the caller's choice). Log lines matching
    ``error_line`` are quoted first when the server fails, because the reason for a
    failed start is often far above the end of the log.
    """

    def __init__(
        self,
        command: Sequence[str],
        log_file: str | os.PathLike[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str = "server",
        error: type[ServerProcessError] = ServerProcessError,
        error_line: re.Pattern[str] | None = None,
    ):
        self.command = list(command)
        self.log_file: str | os.PathLike[str] | None = log_file
        self.env, self.cwd, self.name, self.error, self.error_line = env, cwd, name, error, error_line
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # this run's part of a log file that may hold earlier runs
        self._detached_log: str | None = None

    @property
    def pid(self) -> int | None:
        """Process id (also the process-group id), None before :meth:`start`."""
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # --- start -------------------------------------------------------------
    def start(self) -> ServerProcess:
        """Launch the command; returns at once (see :meth:`wait_ready`)."""
        assert self.log_file is not None and self._proc is None
        Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab", buffering=0) as log:  # the child keeps its own copy
            self._log_start = log.tell()
            try:
                self._proc = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=None if self.cwd is None else str(self.cwd),
                    start_new_session=True,  # own process group, so stop() takes its children too
                )
            except OSError as exc:
                raise self.error(f"could not execute {self.command[0]}: {exc}") from exc
        return self

    def wait_ready(self, ready: Callable[[], bool], deadline: float, poll_s: float = 0.25,
                   give_up: Callable[[], object] | None = None) -> None:
        """Poll ``ready()`` until it is true.

        If the process exits first, or ``deadline`` (``time.monotonic()``) passes,
        ``give_up`` runs (default :meth:`stop`) and the error quotes the log.
        """
        assert self._proc is not None
        give_up = give_up or self.stop
        while True:
            code = self._proc.poll()
            if code is not None:
                give_up()
                raise self.error(
                    f"{self.name} exited with code {code} before becoming ready; {self.failure_details()}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                give_up()
                raise self.error(f"{self.name} not ready in time; {self.failure_details()}")
            time.sleep(poll_s)

    # --- stop --------------------------------------------------------------
    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int | None:
        """:meth:`ask_to_exit`, then :meth:`kill_group`; the exit code (None if never started)."""
        if self._proc is None:
            return None
        self.ask_to_exit(timeout, sig)
        return self.kill_group()

    def ask_to_exit(self, timeout: float, sig: int = signal.SIGTERM, gave_up: str | None = None,
                    grace_s: float = 0.5) -> None:
        """Send ``sig`` to the server (not its group: it stops its own children) and
        wait up to ``timeout`` seconds for it to exit; or, once the log shows the line
        ``gave_up`` after the signal (the server says it abandons its graceful stop),
        ``grace_s`` more: what follows is its teardown, which the caller cuts short."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        start = self._log_size()
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if gave_up and gave_up in self._log_from(start):
                deadline = min(deadline, time.monotonic() + grace_s)
                gave_up = None
            try:
                proc.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass

    def kill_group(self, wait_s: float = 10.0) -> int:
        """SIGKILL what is left of the process group (a hung server, or children it
        orphaned), reap the server and wait until the group is gone."""
        proc = self._proc
        assert proc is not None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired as exc:
            raise self.error(f"{self.name} pid {proc.pid} did not exit after SIGKILL") from exc
        _wait_group_gone(proc.pid, timeout=5.0)
        return proc.returncode

    def group_command_lines(self) -> list[list[str]]:
        """Command lines of the live processes in the server's group (Linux ``/proc``)."""
        return [] if self._proc is None else list(group_command_lines(self._proc.pid).values())

    # --- log ---------------------------------------------------------------
    def read_log(self, max_bytes: int = 4 * 1024 * 1024) -> str:
        """This run's log text (at most the last ``max_bytes``)."""
        if not self.log_file:
            return self._detached_log or ""
        try:
            with open(self.log_file, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self._log_start, size - max_bytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return self._detached_log or ""

    def _log_size(self) -> int:
        try:
            return os.path.getsize(self.log_file) if self.log_file else 0
        except OSError:
            return 0

    def _log_from(self, offset: int) -> str:
        """What the log file holds past byte ``offset`` ("" without one)."""
        if not self.log_file:
            return ""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def detach_log(self) -> None:
        """Keep this run's log text in memory and stop reading the file (before it is deleted)."""
        self._detached_log = self.read_log()
        self.log_file = None

    def log_tail(self, n: int = 50) -> str:
        """Last ``n`` lines this run wrote to the log ("" if none)."""
        return "\n".join(deque(self.read_log().splitlines(), maxlen=n))

    def error_lines(self, n: int = 10) -> list[str]:
        """Last ``n`` lines of this run's log that match ``error_line``."""
        if self.error_line is None:
            return []
        return [ln for ln in self.read_log().splitlines() if self.error_line.match(ln)][-n:]

    def failure_details(self) -> str:
        """The log's error lines and its end, for an error message."""
        tail = self.log_tail(30)
        if self.error_line is None:
            return f"log {self.log_file} ends with:\n{tail}"
        errors = "\n".join(self.error_lines()) or "(none)"
        return f"errors in log {self.log_file}:\n{errors}\nlog ends with:\n{tail}"


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Wait until no process of the group is left (zombies reaped by init count as gone late)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
