"""Start and stop a real ``tritonserver`` process for serving and integration tests.

Finding the binary and preparing its environment is in
:mod:`pagedserve.client.tritonserver_install`; running the process (log file,
readiness polling, process-group stop) in :mod:`pagedserve.client.process`. What is
left here is Triton's own: its command line, ports, ``/v2/health`` endpoints, and the
python backend's shared-memory regions that a killed stub leaves in ``/dev/shm``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .process import ServerProcess, free_port, http_status
from .tritonserver_install import TritonServerError, find_tritonserver, prepare_backend_dir, server_env

__all__ = [
    "TritonServerError",
    "TritonServer",
    "find_tritonserver",
    "prepare_backend_dir",
    "free_port",
]


# glog error lines ("E1123 06:19:42.609405 6023 file.cc:703] ..."), the final
# "error: ..." line, and a C++ abort ("terminate called after throwing ...").
_ERROR_LINE = re.compile(r"^(E\d{4} |error: |terminate called|\s+what\(\): )")
# Name prefix of the python backend's per-stub shared-memory regions in /dev/shm.
_SHM_PREFIX = "triton_python_backend_shm_region_"
EXIT_GAVE_UP = "Exit timeout expired. Exiting immediately."
"""What Triton logs when its exit timeout passes with models still loaded: the stop is over."""


@dataclass
class TritonServer:
    """One ``tritonserver`` subprocess in its own process group.

    Ports left at 0 are picked free at every :meth:`start`. By default every
    model in the repository is loaded (``--model-control-mode=none``); ``models``
    names the ones to load instead (explicit mode), which starts sooner: every
    python model is a stub process of its own (``["llm"]`` where only the engine's
    model is spoken to).
    ``extra_args`` are appended verbatim (e.g. ``["--allow-metrics=false"]``);
    ``env`` entries override the computed environment (``None`` removes a
    variable). stdout and stderr of the server and of python-model stubs go to
    ``log_file`` (default: ``tritonserver.log`` in a temporary workdir).
    ``exit_timeout_s`` sets Triton's own grace period for in-flight requests on
    shutdown (``--exit-timeout-secs``, Triton's default is 30 s).

    Leaving a ``with`` block stops the server and deletes the temporary workdir
    (log included); the end of the log stays available through :meth:`log_tail`.
    """

    model_repository: str | os.PathLike[str]
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    log_file: str | os.PathLike[str] | None = None
    model_control_mode: str = "none"
    models: list[str] | None = None
    exit_timeout_s: int | None = None
    executable: str | None = None
    workdir: str | os.PathLike[str] | None = None

    _process: ServerProcess | None = field(default=None, init=False, repr=False)
    _own_workdir: bool = field(default=False, init=False, repr=False)
    _auto_ports: tuple[str, ...] = field(default=(), init=False, repr=False)
    _shm_regions: set[str] = field(default_factory=set, init=False, repr=False)

    # --- addresses ---------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``localhost:PORT``, the form tritonclient.http expects."""
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``localhost:PORT``, the form tritonclient.grpc expects."""
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus endpoint (nothing listens there with ``--allow-metrics=false``)."""
        return f"http://localhost:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        """Server process id (also its process-group id), None before start."""
        return self._process.pid if self._process is not None else None

    # --- lifecycle ---------------------------------------------------------
    def command(self, backend_dir: str | None = None) -> list[str]:
        """The command line :meth:`start` runs (with the ports currently set)."""
        exe = self.executable or find_tritonserver()
        cmd = [
            exe,
            f"--model-repository={Path(self.model_repository).resolve()}",
            f"--model-control-mode={'explicit' if self.models is not None else self.model_control_mode}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={int(self.log_verbose)}",
        ]
        if self.exit_timeout_s is not None:
            cmd.append(f"--exit-timeout-secs={int(self.exit_timeout_s)}")
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        cmd.extend(f"--load-model={name}" for name in self.models or ())
        cmd.extend(self.extra_args)
        return cmd

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Launch the server and block until ``/v2/health/ready`` answers 200.

        Readiness is polled over HTTP, so ``--allow-http=false`` is refused.
        If the process exits first or ``timeout`` passes, the server is stopped
        and :class:`TritonServerError` carries the log's error lines and tail.
        A bind clash on ports we picked ourselves is retried with new ports.
        """
        if self.is_running():
            raise TritonServerError(f"tritonserver already running (pid {self.pid})")
        if any(a.strip().lower() in ("--allow-http=false", "--allow-http=0") for a in self.extra_args):
            raise TritonServerError("readiness is checked over HTTP; do not pass --allow-http=false")
        if not Path(self.model_repository).is_dir():
            raise TritonServerError(f"model repository {self.model_repository} is not a directory")
        self.executable = self.executable or find_tritonserver()

        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="pagedserve-triton-")
            self._own_workdir = True
        workdir = Path(self.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        backend_dir = prepare_backend_dir(workdir, self.executable)
        if self.log_file is None:
            self.log_file = str(workdir / "tritonserver.log")

        if not self._auto_ports:
            self._auto_ports = tuple(
                a for a in ("http_port", "grpc_port", "metrics_port") if not getattr(self, a)
            )
        deadline = time.monotonic() + timeout
        attempts = 3 if self._auto_ports else 1
        for attempt in range(attempts):
            self._pick_ports()
            process = self._launch(backend_dir, workdir)
            ready_url = self._http("/v2/health/ready")
            try:
                process.wait_ready(
                    lambda: http_status(ready_url) == 200,  # noqa: B023 - called in this iteration only
                    deadline,
                    give_up=self.stop,
                )
                return self
            except TritonServerError:
                port_clash = any("already in use" in ln for ln in self.error_lines())
                if attempt + 1 < attempts and port_clash and time.monotonic() < deadline:
                    continue
                raise
        raise AssertionError("unreachable")

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGINT (graceful), wait, then SIGKILL the whole process group and wait.

        ``timeout`` defaults to Triton's exit timeout plus 3 s, so a graceful
        shutdown is not cut short. The group kill also takes python-backend stubs
        a dying server may leave behind, so ports are free when this returns.
        Returns the server's exit code (None if it was never started).
        """
        process = self._process
        if process is None:
            return None
        if timeout is None:
            timeout = float(self.exit_timeout_s if self.exit_timeout_s is not None else 30) + 3.0
        self._shm_regions |= _stub_shm_regions(process)
        # Once Triton 2.51 logs EXIT_GAVE_UP it exits with its python models' unload threads still
        # waiting on stubs that never exit (python_backend's TerminateStub waits without a bound):
        # that teardown crashes (Signal 11, a pthread mutex assertion, heap corruption) or hangs,
        # so the stop kills the group then instead of waiting out `timeout` (issue 43).
        process.ask_to_exit(timeout, signal.SIGINT, gave_up=EXIT_GAVE_UP)
        code = self._kill_group(process)  # a hung server, or stubs it orphaned
        atexit.unregister(self._kill_at_exit)
        return code

    def kill(self) -> int | None:
        """SIGKILL the server and its stubs at once, as a crash would (fault tests); `start`
        brings it back on the same ports where they were given."""
        return self._kill_group(self._process) if self._process is not None else None

    def _kill_group(self, process: ServerProcess) -> int:
        self._shm_regions |= _stub_shm_regions(process)
        code = process.kill_group()
        # A killed stub cannot unlink its shared-memory region; do it for it.
        for region in self._shm_regions:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", region))
        self._shm_regions.clear()
        return code

    def cleanup(self) -> None:
        """Stop if needed and delete the temporary workdir :meth:`start` created.

        The end of the log is kept in memory first, so :meth:`log_tail` and
        :meth:`error_lines` still work afterwards.
        """
        if self.is_running():
            self.stop()
        if self._own_workdir and self.workdir is not None:
            if self.log_file and Path(self.log_file).resolve().is_relative_to(Path(self.workdir).resolve()):
                if self._process is not None:
                    self._process.detach_log()
                self.log_file = None
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
            self._own_workdir = False

    def __enter__(self) -> TritonServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def is_running(self) -> bool:
        """True while the server process exists (it may not be ready yet)."""
        return self._process is not None and self._process.is_running()

    # --- readiness ---------------------------------------------------------
    def is_ready(self) -> bool:
        """Server-level readiness (``GET /v2/health/ready`` is 200)."""
        return self.is_running() and http_status(self._http("/v2/health/ready")) == 200

    def wait_model_ready(self, name: str, timeout: float = 60.0, version: str | int | None = None) -> None:
        """Block until ``/v2/models/{name}[/versions/{version}]/ready`` answers 200.

        Useful with ``model_control_mode="explicit"`` or after a reload; with the
        default mode every model is ready once :meth:`start` returns.
        """
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version is not None else "") + "/ready"
        deadline = time.monotonic() + timeout
        while True:
            if not self.is_running():
                raise TritonServerError(f"tritonserver is not running; {self._failure_details()}")
            if http_status(self._http(path)) == 200:
                return
            if time.monotonic() > deadline:
                raise TritonServerError(f"model {name!r} not ready after {timeout:.0f}s; {self._failure_details()}")
            time.sleep(0.25)

    # --- logs --------------------------------------------------------------
    def log_tail(self, n: int = 50) -> str:
        """Last ``n`` lines this run wrote to the log ("" if none)."""
        return self._process.log_tail(n) if self._process is not None else ""

    def error_lines(self, n: int = 10) -> list[str]:
        """Last ``n`` error lines of this run's log.

        Model-load failures are logged long before the shutdown chatter that
        ends the log, so a plain tail often misses the reason.
        """
        return self._process.error_lines(n) if self._process is not None else []

    # --- internals ---------------------------------------------------------
    def _http(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def _pick_ports(self) -> None:
        taken = {getattr(self, a) for a in ("http_port", "grpc_port", "metrics_port")} - {0}
        for attr in self._auto_ports:
            taken.discard(getattr(self, attr))
        for attr in self._auto_ports:
            port = free_port(taken)
            taken.add(port)
            setattr(self, attr, port)

    def _launch(self, backend_dir: str | None, workdir: Path) -> ServerProcess:
        assert self.log_file is not None and self.executable is not None
        self._process = ServerProcess(
            self.command(backend_dir),
            self.log_file,
            env=server_env(self.executable, self.env),
            cwd=workdir,
            name="tritonserver",
            error=TritonServerError,
            error_line=_ERROR_LINE,
        ).start()
        atexit.register(self._kill_at_exit)
        return self._process

    def _failure_details(self) -> str:
        return self._process.failure_details() if self._process is not None else "it was never started"

    def _kill_at_exit(self) -> None:
        """Never leave a server holding ports when the Python process ends."""
        with contextlib.suppress(Exception):
            self.stop(timeout=5.0)


def _stub_shm_regions(process: ServerProcess) -> set[str]:
    """Shared-memory region names on the command lines of the server group's python stubs."""
    return {
        arg
        for command_line in process.group_command_lines()
        for arg in command_line
        if arg.startswith(_SHM_PREFIX) and "/" not in arg
    }
