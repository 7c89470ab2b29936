"""EngineThread: an LLMEngine built and driven by a background thread.

Built there, not handed over, because of torch's OpenMP runtime on Linux (libgomp): each
OS thread that runs a parallel op owns a team of workers, and once the process has more
of those than CPUs, libgomp cuts its workers' spin-wait to almost nothing, so every op
after has to wake sleeping workers. A model loaded on Triton's thread and stepped on
this one made two teams: decode steps ran much slower served than offline (one sequence,
bf16, 2 cores; benchmarks/RESULTS.md, "Figures behind design choices in the code").
One thread for load and steps: one team.

Any thread may submit or abort; requests enter the engine at the start of the
next step (so an abort frees its blocks within one step). Outputs reach each
request's callback from the engine thread, which the callback must not block.
A step that raises costs the requests in flight (each gets an error as its final
output), not the engine: its state is rebuilt and the next request is served. A step
that runs past `step_timeout_s` (a device or a kernel stuck) costs the same: a watchdog
thread fails the requests in flight and refuses new ones (`is_ready` is False, so the
model reports not ready), and when the step returns the engine is rebuilt the same way.
A Python thread cannot be interrupted: a step that never returns leaves the engine not
ready until the server is restarted, which is what a readiness probe is for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator, Sequence as Seq

from .engine import LLMEngine
from .errors import EngineDeadError, EngineHungError, EngineStepError
from .outputs import RequestOutput
from .process_tuning import name_native_thread
from .sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")

OutputCallback = Callable[[RequestOutput], None]


class EngineThread:
    engine: LLMEngine

    def __init__(self, make_engine: Callable[[], LLMEngine], on_step: Callable[[], None] | None = None,
                 step_timeout_s: float = 0.0):
        """Start the thread, build the engine on it (`make_engine()`), and return once it is
        ready; an error while building is raised here. `step_timeout_s` > 0 starts the watchdog."""
        self.on_step = on_step
        self.step_timeout_s = step_timeout_s
        self.error: BaseException | None = None
        self.hung_since: float | None = None
        """When the step the watchdog found hung began; None once the engine was rebuilt after it."""
        self.num_hangs = 0
        self._lock = threading.Lock()
        self._delivery = threading.RLock()
        """Held by the engine thread whenever it touches callbacks (all but the step itself), and by
        the watchdog while it fails a hung step's requests: no output after a request's error final."""
        self._wake = threading.Event()
        self._adds: deque[tuple[str, list[int], SamplingParams, OutputCallback, Any]] = deque()
        self._aborts: deque[str] = deque()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self._stopped = threading.Event()
        self._step_started: float | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._build_and_run, args=(make_engine,), name="pagedserve-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        if step_timeout_s > 0:
            self._watchdog = threading.Thread(target=self._watch_steps, name="pagedserve-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def is_ready(self) -> bool:
        """Serving: alive, not shutting down, no step hung (the model's readiness and gauge)."""
        return self.is_alive and not self._stopping and self.hung_since is None

    def prompt_inputs(self, prompt: Any) -> tuple[list[int], Any]:
        """The engine's `prompt_inputs` (tokens, and a prompt's images processed), on the caller's thread:
        a picture's decoding and resizing never stall a step."""
        return self.engine.prompt_inputs(prompt)

    def submit(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, on_output: OutputCallback,
        mm: Any = None,
    ) -> None:
        """Validate and queue a request. Raises InvalidRequestError, QueueFullError, EngineDeadError.

        The engine's state is read under the lock that its death and shutdown take too, so a
        request is either refused here or in the inbox when the engine fails it: never lost.
        A grammar is compiled before that lock is taken: the engine thread takes it to read
        its inbox, and a compile under it would stall every running stream."""
        ids = [int(t) for t in prompt_token_ids]
        if params.structured_outputs is not None:  # compiled here, not under the lock the engine thread takes
            self.engine.grammars.prepare(params.structured_outputs)
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine failed earlier ({self.error!r}); restart the model")
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            if self.hung_since is not None:
                raise EngineDeadError(
                    f"an engine step has hung for {time.monotonic() - self.hung_since:.0f} s (past step_timeout_s="
                    f"{self.step_timeout_s:g}); the model reports not ready until it returns; retry on another replica")
            self.engine.check_admission(ids, params, arriving=len(self._adds))
            self._adds.append((request_id, ids, params, on_output, mm))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def stream(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Submit and iterate over the request's outputs (ends after the finished one)."""
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.submit(request_id, prompt_token_ids, params, outputs.put)
        while True:
            output = outputs.get()
            yield output
            if output.finished:
                return

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (callbacks get their final output), join the thread,
        and close the engine (its tensor-parallel workers end)."""
        with self._lock:
            self._stopping = True
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0fs", timeout)
        self.engine.close()

    # -- engine thread ---------------------------------------------------------
    def _build_and_run(self, make_engine: Callable[[], LLMEngine]) -> None:
        name_native_thread(self._thread.name)  # before the engine starts its OpenMP workers, which inherit it
        try:
            self.engine = make_engine()
        except BaseException as error:  # noqa: BLE001 - raised again in the thread that started the engine
            self._build_error = error
            return
        finally:
            self._built.set()
        self._run()

    def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests() and not self._adds and not self._stopping:
                self._wake.wait()
            self._wake.clear()
            try:
                with self._delivery:
                    if self.hung_since is not None and not self._rebuild_after_hang():
                        return
                    self._apply_inbox()
                    if self._stopping:
                        self._abort_all()
                        self._fail_inbox(EngineDeadError("the engine shut down"))  # added since the inbox was read
                        return
                if self.engine.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    try:
                        outputs = self.engine.step()  # not under _delivery: the watchdog may fail its requests meanwhile
                    finally:
                        self._step_started = None
                    with self._delivery:
                        if self.hung_since is None:  # else the requests got their error finals already
                            for output in outputs:
                                self._deliver(output)
                    if self.on_step is not None:
                        self.on_step()
            except Exception as error:  # noqa: BLE001 - any failed step: logged, its requests failed, the engine reset
                with self._delivery:
                    if not self._recover(error):
                        return

    def _watch_steps(self) -> None:
        """The watchdog: a step running past step_timeout_s fails every request in flight."""
        interval = min(1.0, self.step_timeout_s / 10)
        while not self._stopped.wait(interval):
            started = self._step_started
            if started is None or self.hung_since is not None or time.monotonic() - started < self.step_timeout_s:
                continue
            with self._delivery:
                if self._step_started != started:  # it returned meanwhile
                    continue
                with self._lock:
                    self.hung_since, self.num_hangs = started, self.num_hangs + 1
                logger.error("engine step hung: running %.0f s (step_timeout_s=%g); failing %d requests, "
                             "not ready until it returns", time.monotonic() - started, self.step_timeout_s,
                             len(self._callbacks))
                hung = EngineHungError(
                    f"the engine step ran past step_timeout_s={self.step_timeout_s:g} s; this request was dropped "
                    "and the model reports not ready until the engine recovers: retry, on another replica if one is ready"
                )
                self._fail_all(hung)
                self._fail_inbox(hung)

    def _rebuild_after_hang(self) -> bool:
        """The hung step returned (its outputs were dropped): the engine's state is rebuilt as after
        a failed step, then new requests are taken again. False when that failed: the engine is dead."""
        logger.warning("the hung engine step returned after %.0f s; rebuilding the engine's state",
                       time.monotonic() - (self.hung_since or 0.0))
        try:
            self.engine.recover_from_failure()
        except Exception as reset_error:  # noqa: BLE001 - a failed reset: the engine is dead, logged in _die
            self._die(reset_error)
            return False
        with self._lock:
            self.hung_since = None
        return True

    def _recover(self, error: Exception) -> bool:
        """After a failed step: error every request in flight (each gets its one final
        output), then give the engine a clean state so the next request is served.
        False when even that failed: the engine is dead and every later submit says so."""
        logger.exception("engine step failed; dropping %d requests and recovering", len(self._callbacks))
        failure = EngineStepError(
            f"the engine step failed ({type(error).__name__}: {error}); this request was dropped "
            "and the engine recovered, so retrying it may succeed"
        )
        self._fail_all(failure)
        try:
            self.engine.recover_from_failure()
        except Exception as reset_error:  # noqa: BLE001 - a failed reset: the engine is dead, logged in _die
            self._die(reset_error)
            return False
        return True

    def _die(self, reset_error: Exception) -> None:
        logger.exception("engine recovery failed")
        with self._lock:  # from here submit refuses; what it queued before is failed below
            self.error = reset_error
        self._fail_all(reset_error)
        self._fail_inbox(reset_error)

    def _apply_inbox(self) -> None:
        while self._adds:
            with self._lock:
                request_id, ids, params, callback, mm = self._adds.popleft()
            self._callbacks[request_id] = callback
            try:
                self.engine.add_processed(ids, mm, params, request_id=request_id)
            except Exception as error:  # noqa: BLE001 - admitted already: a duplicate id, or a lost race for the last queue slot
                self._deliver(_error_output(request_id, error))
        while self._aborts:
            output = self.engine.abort(self._aborts.popleft())
            if output is not None:
                self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        """With _delivery held."""
        callback = self._callbacks.pop(output.request_id) if output.finished else self._callbacks.get(output.request_id)
        if callback is None:
            return
        try:
            callback(output)
        except Exception:
            logger.exception("output callback of request %s failed", output.request_id)

    def _abort_all(self) -> None:
        for request_id in list(self._callbacks):
            output = self.engine.abort(request_id)
            self._deliver(output or _error_output(request_id, EngineDeadError("the engine shut down")))

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._callbacks):
            self._deliver(_error_output(request_id, error))

    def _fail_inbox(self, error: BaseException) -> None:
        """Requests accepted but never added get their final too."""
        while self._adds:
            with self._lock:
                request_id, _, _, callback, _ = self._adds.popleft()
            self._callbacks[request_id] = callback
            self._deliver(_error_output(request_id, error))


def _error_output(request_id: str, error: BaseException) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        context_token_ids=[],
        text="",
        finished=True,
        finish_reason="error",
        error=f"{type(error).__name__}: {error}",
    )
