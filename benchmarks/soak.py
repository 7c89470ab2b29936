"""Soak test of the served path: many requests against the `llm` model over gRPC
streaming (tritonclient), a mix that includes client cancellations and logprobs, while
the server's processes are watched; at the end, a verdict on the server's health.

    python benchmarks/soak.py --num-requests 5000 --concurrency 32 --malloc-debug
    python benchmarks/soak.py --url localhost:8001 --server-log /path/tritonserver.log

The mix (seeded: request i depends only on --seed and i):
* 80% plain: text in, text out, no return_* flags; greedy or seeded sampling, most
  with ignore_eos so output lengths are what was asked;
* 10% cancelled by the client: after k responses (k random, 0 = after a random short
  delay, before or while the first tokens come) the stream is stopped with
  `stop_stream(cancel_requests=True)`;
* 10% with logprobs: sampling parameter `logprobs` (0-5) and a random subset of
  `return_finish_reason` / `return_logprobs` / `return_num_output_tokens` /
  `return_cumulative_logprob`; what comes back is checked against what was asked.
A quarter of the prompts start with one of three shared prefixes (prefix-cache hits
and shared blocks); prompts and outputs are short: this is about health, not speed.

Every --sample-interval seconds (default 10): RSS and thread count of tritonserver and
of each `triton_python_backend_stub` in its process group, and /dev/shm (files, bytes).

Verdict: requests sent / completed / cancelled / errors by message; lost finals (no
final response and no error within --final-timeout); KV blocks used once idle (metric
`pagedserve:kv_blocks_used`); health after the load (/v2/health/ready and one more
request); stub aborts (server log lines; stub processes replaced); RSS growth per
1,000 requests after warm-up (the first 10% of requests excluded; least squares).

With --malloc-debug the python stubs run under PYTHONMALLOC=debug, which makes a
Python-heap free without the GIL (a relay-safety bug) abort the stub at once.

Only localhost is ever contacted. One file on purpose (over 300 lines): plan, send,
watch, judge and report are one script's steps and share its small records.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pagedserve.client.client import build_inputs, parse_result
from pagedserve.client.loadgen import Distribution, SyntheticWorkload
from pagedserve.client.process import group_command_lines, http_status, proc_stat_fields
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

RETURN_FLAGS_OUTPUTS = {  # the return_* flags the mix varies, and the output each one asks for
    "return_finish_reason": "finish_reason",
    "return_logprobs": "logprobs",
    "return_num_output_tokens": "num_output_tokens",
    "return_cumulative_logprob": "cumulative_logprob",
}
RETURN_FLAGS = tuple(RETURN_FLAGS_OUTPUTS)
STUB = "triton_python_backend_stub"
SHM_PREFIX = "triton_python_backend_shm_region_"
# A stub's or the server's death in its log ("Signal (2|15) received." is an ordinary stop).
ABORT = re.compile(r"Fatal Python error|Stub process|is not healthy|Debug memory block|Segmentation fault|"
                   r"double free|corrupted|core dumped|terminate called|Signal \((?!2\)|15\))\d+\) received")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
# Errors a client may see on a request it cancelled itself.
CANCEL_ERROR = re.compile(r"cancel", re.I)


# --------------------------------------------------------------------------- the mix


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # plain | cancel | logprobs
    prompt: str
    sampling: dict[str, Any]
    returns: tuple[str, ...] = ()
    cancel_after: int | None = None  # responses before the client cancels (cancel kind)
    cancel_delay: float = 0.0  # with cancel_after == 0: seconds before cancelling


class Mix:
    """Request i of a seeded soak: kind, prompt, sampling, flags (see the module docstring)."""

    def __init__(self, seed: int = 0, prompt_len: tuple[int, int] = (40, 36), output_len: tuple[int, int] = (16, 12)):
        self.seed = seed
        self.workload = SyntheticWorkload(prompt_len[0], prompt_len[1], output_len[0], output_len[1], seed, tokenizer=None)
        self.prefixes = [self.workload.request(-1 - i).prompt for i in range(3)]

    def request(self, index: int) -> SoakRequest:
        rng = random.Random(f"soak:{self.seed}:{index}")
        spec = self.workload.request(index)
        prompt = f"{rng.choice(self.prefixes)} {spec.prompt}" if rng.random() < 0.25 else spec.prompt
        sampling: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": 0.0}
        if rng.random() < 0.5:
            sampling |= {"temperature": 0.8, "top_p": 0.95, "seed": index}
        roll = rng.random()
        if roll < 0.1:
            k = rng.randint(0, max(0, spec.max_tokens - 2))
            return SoakRequest(index, "cancel", prompt, sampling | {"ignore_eos": True}, (), k, rng.uniform(0.0, 0.5))
        if roll < 0.2:
            returns = tuple(flag for flag in RETURN_FLAGS if rng.random() < 0.5)
            return SoakRequest(index, "logprobs", prompt, sampling | {"ignore_eos": True, "logprobs": rng.randint(0, 5)},
                               returns)
        return SoakRequest(index, "plain", prompt, sampling | {"ignore_eos": rng.random() < 0.7})


# --------------------------------------------------------------------------- one request


@dataclass
class Outcome:
    index: int
    kind: str
    status: str = "lost"  # completed | cancelled | refused (a fuzz case's named error) | error | lost
    responses: int = 0
    error: str | None = None
    expected_error: bool = False  # an error on a request the client cancelled
    problems: list[str] = field(default_factory=list)  # what came back differs from what was asked
    e2e: float | None = None
    request_id: str = ""


def grpc_inputs(module: Any, req: SoakRequest) -> list[Any]:
    """`llm` inputs with exactly the asked return_* flags."""
    return build_inputs(module, req.prompt, stream=True, returns=req.returns, **req.sampling)


def send(url: str, req: SoakRequest, final_timeout: float, died_at: Callable[[], float | None] = lambda: None,
         grace: float = 10.0, model: str = "llm", close_timeout: float = 30.0) -> Outcome:
    """One streaming request; never raises. Lost: neither a final response nor an
    error within `final_timeout` seconds of sending, or within `grace` seconds of a
    stub's death (`died_at()`, a time.monotonic() value): Triton 2.51 answers nothing
    for requests a dead stub held, so waiting longer only makes the run slower."""
    import tritonclient.grpc as grpcclient

    outcome = Outcome(req.index, req.kind, request_id=f"soak-{req.index}-{uuid.uuid4().hex[:8]}")
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    cancel = gave_up = False
    sent = time.monotonic()
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, grpc_inputs(grpcclient, req), request_id=outcome.request_id)
        received: list[Any] = []
        if req.cancel_after == 0:
            time.sleep(req.cancel_delay)
            cancel = True
        while not cancel:
            died = died_at()
            deadline = sent + final_timeout if died is None else min(sent + final_timeout, max(died, sent) + grace)
            try:
                result, error = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                cancel = gave_up = True  # lost: give the stream up
                outcome.problems.append(f"no final response within {deadline - sent:.0f} s")
                break
            if error is not None:
                outcome.status, outcome.error = "error", str(error)
                break
            chunk = parse_result(result)
            received.append(result)
            outcome.responses += 1
            if chunk.final:
                outcome.status, outcome.e2e = "completed", time.monotonic() - sent
                break
            if req.cancel_after is not None and outcome.responses >= req.cancel_after:
                cancel = True
        if cancel and not gave_up and outcome.status == "lost":
            outcome.status = "cancelled"
        if outcome.status == "completed":
            outcome.problems += check_outputs(req, received)
    except Exception as exc:  # noqa: BLE001 (recorded; the soak goes on)
        outcome.status, outcome.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        _close(client, cancel or outcome.status != "completed", close_timeout, outcome)
    if outcome.status == "cancelled":
        while not results.empty():  # what had arrived before the cancel took effect
            _, error = results.get_nowait()
            if error is not None and outcome.error is None:
                outcome.error = str(error)
        outcome.expected_error = outcome.error is not None and bool(CANCEL_ERROR.search(outcome.error))
    return outcome


def _close(client: Any, cancel: bool, timeout: float, outcome: Outcome) -> None:
    """stop_stream (cancelling when asked); a stream that will not close after its
    final response is a problem, then cancelled so the soak goes on."""
    closer = threading.Thread(target=client.stop_stream, kwargs={"cancel_requests": cancel}, daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        outcome.problems.append(f"the stream did not close within {timeout:g} s")
        client.stop_stream(cancel_requests=True)
        closer.join(5)
    client.close()


def check_outputs(req: SoakRequest, results: list[Any]) -> list[str]:
    """What a completed request got back against what it asked for."""
    problems: list[str] = []
    arrays = {name: [r.as_numpy(name) for r in results] for name in RETURN_FLAGS_OUTPUTS.values()}
    for flag, output in RETURN_FLAGS_OUTPUTS.items():
        present = [a is not None and a.size > 0 for a in arrays[output]]
        if flag in req.returns and not all(present):
            problems.append(f"{output} asked but missing in {present.count(False)} of {len(present)} responses")
        if flag not in req.returns and any(present):
            problems.append(f"{output} not asked but returned")
    if "return_finish_reason" in req.returns and arrays["finish_reason"][-1] is not None:
        reason = arrays["finish_reason"][-1].reshape(-1)[0].decode()
        if reason not in ("stop", "length"):
            problems.append(f"final finish_reason {reason!r}")
    tokens = None
    if "return_num_output_tokens" in req.returns:
        tokens = sum(int(a.sum()) for a in arrays["num_output_tokens"] if a is not None)
        if req.sampling.get("ignore_eos") and tokens != req.sampling["max_tokens"]:
            problems.append(f"{tokens} output tokens, asked {req.sampling['max_tokens']} with ignore_eos")
    if "return_logprobs" in req.returns:
        positions = [p for a in arrays["logprobs"] if a is not None and a.size for p in json.loads(a.reshape(-1)[0])]
        if tokens is not None and len(positions) != tokens:
            problems.append(f"{len(positions)} logprobs positions for {tokens} tokens")
        if any(not 1 <= len(p) <= req.sampling["logprobs"] + 1 for p in positions):
            problems.append("a logprobs position with the wrong number of entries")
    return problems



# --------------------------------------------------------------------------- watching the server


@dataclass
class Sample:
    t: float  # seconds since the load started
    done: int  # requests finished by then
    rss: dict[str, int] = field(default_factory=dict)  # process label -> bytes
    threads: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    shm_files: int = 0
    shm_bytes: int = 0


def group_processes(pgid: int) -> dict[str, dict[str, int]]:
    """Processes of a process group (Linux /proc): label -> pid, rss, threads. The
    server is `tritonserver`, a python stub is `stub:<model>`."""
    found: dict[str, dict[str, int]] = {}
    for pid, command_line in group_command_lines(pgid).items():
        args = [a for a in command_line if a]
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if not args or "VmRSS" not in status:
            continue
        label = Path(args[0]).name
        if label == STUB:
            model = next((Path(a).parts[-3] for a in args if a.endswith("/model.py")), args[1] if len(args) > 1 else "?")
            label = f"stub:{model}"
        found[label if label not in found else f"{label}:{pid}"] = {
            "pid": pid, "rss": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"])}
    return found


def shm_usage(prefix: str = "") -> tuple[int, int]:
    """Files in /dev/shm whose name starts with `prefix`, and the bytes they occupy."""
    files = allocated = 0
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(prefix):
            try:
                allocated += entry.stat(follow_symlinks=False).st_blocks * 512
                files += 1
            except OSError:
                pass
    return files, allocated


class Watcher(threading.Thread):
    """Samples the server's processes and /dev/shm every `interval` seconds; checks
    every second that the processes of the first sample are alive (`died_at`, `died`)."""

    def __init__(self, pgid: int | None, shm_prefix: str, interval: float, progress: Callable[[], int]):
        super().__init__(name="soak-watcher", daemon=True)
        self.pgid, self.shm_prefix, self.interval, self.progress = pgid, shm_prefix, interval, progress
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self.stopping = threading.Event()
        self.died_at: float | None = None
        self.died = ""

    def sample(self) -> Sample:
        s = Sample(round(time.monotonic() - self.t0, 1), self.progress())
        for label, proc in (group_processes(self.pgid) if self.pgid else {}).items():
            s.rss[label], s.threads[label], s.pids[label] = proc["rss"], proc["threads"], proc["pid"]
        s.shm_files, s.shm_bytes = shm_usage(self.shm_prefix)
        self.samples.append(s)
        return s

    def check_alive(self) -> None:
        """Note the first time a process of the first sample is gone (also called by
        senders after an error, so a dead server stops the load at once)."""
        gone = [f"{label} (pid {pid})" for label, pid in self.samples[0].pids.items() if not _alive(pid)]
        if gone and self.died_at is None:
            self.died_at, self.died = time.monotonic(), ", ".join(gone)

    def run(self) -> None:
        last = time.monotonic()
        while not self.stopping.wait(1.0):
            if self.died_at is None:
                self.check_alive()
                if self.died_at is not None:
                    self.sample()
            if time.monotonic() - last >= self.interval:
                last = time.monotonic()
                self.sample()


def _alive(pid: int) -> bool:
    fields = proc_stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")  # state: zombie or dead


def find_server_pid(grpc_port: int) -> int | None:
    """A running tritonserver listening on `grpc_port` (by its command line)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if Path(args[0]).name == "tritonserver" and f"--grpc-port={grpc_port}" in args:
                return int(entry)
    return None


# --------------------------------------------------------------------------- after the load


def read_metrics(metrics_url: str, names: tuple[str, ...]) -> dict[str, float | None]:
    """Each metric summed over its label sets; None when not exported or unreachable."""
    try:
        body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        body = ""
    state: dict[str, float | None] = {}
    for name in names:
        values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M)]
        state[name] = sum(values) if values else None
    return state


IDLE_GAUGES = ("pagedserve:kv_blocks_used", "pagedserve:num_requests_running", "pagedserve:num_requests_waiting")
"""All 0: the engine is idle."""


def idle_state(metrics_url: str, timeout: float) -> dict[str, float | None]:
    """KV blocks used and requests running / waiting, once they reach 0 (or `timeout`
    passes, or the metrics endpoint does not answer)."""
    deadline = time.monotonic() + timeout
    while True:
        state = read_metrics(metrics_url, IDLE_GAUGES)
        if all(v == 0 for v in state.values()) or all(v is None for v in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.25)


def abort_lines(log_file: str | None) -> list[str]:
    """Server log lines that say a python stub died or its heap was misused."""
    if not log_file or not Path(log_file).exists():
        return []
    with open(log_file, encoding="utf-8", errors="replace") as f:
        return [line.rstrip() for line in f if ABORT.search(line) and not line.startswith("DBG")]


def rss_growth(samples: list[Sample], after: int) -> dict[str, float | None]:
    """Bytes of RSS per 1,000 requests (least-squares slope over samples taken once
    `after` requests were done; None with fewer than two distinct points)."""
    usable = [s for s in samples if s.done >= after]
    labels = sorted({label for s in usable for label in s.rss})
    growth: dict[str, float | None] = {}
    for label in labels + ["total"]:
        points = [(s.done, sum(s.rss.values()) if label == "total" else s.rss[label])
                  for s in usable if label == "total" or label in s.rss]
        xs = np.array([p[0] for p in points], dtype=float)
        if len(set(xs)) < 2:
            growth[label] = None
            continue
        ys = np.array([p[1] for p in points], dtype=float)
        growth[label] = float(np.polyfit(xs, ys, 1)[0] * 1000)
    return growth


# --------------------------------------------------------------------------- the run


@dataclass
class SoakConfig:
    num_requests: int = 200
    concurrency: int = 16
    max_duration: float = 1500.0  # no new request after this many seconds
    seed: int = 0
    final_timeout: float = 300.0
    sample_interval: float = 10.0
    idle_timeout: float = 60.0
    malloc_debug: bool = False
    keep_going: bool = False  # go on sending after a server process died
    url: str | None = None  # a running server's gRPC address; None: start one
    http_url: str | None = None
    metrics_url: str | None = None
    server_log: str | None = None
    server_pid: int | None = None
    engine: dict[str, str] = field(default_factory=dict)
    server_env: dict[str, str] = field(default_factory=dict)  # e.g. MALLOC_ARENA_MAX, for the server and its stubs
    workdir: str | None = None
    fuzz_share: float = 0.0  # this share of the requests are benchmarks/fuzz.py cases (llm and the TRT-LLM models)
    fuzz_timeout: float = 120.0  # a fuzz case asking a few tokens with no answer after this long is a lost final


@dataclass
class SoakReport:
    config: SoakConfig
    wall_s: float = 0.0
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # unexpected, by message
    expected_errors: dict[str, int] = field(default_factory=dict)  # on requests the client cancelled
    problems: dict[str, int] = field(default_factory=dict)  # outputs that differ from what was asked
    lost_finals: list[str] = field(default_factory=list)  # client request ids
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    e2e: Distribution | None = None
    idle: dict[str, float | None] = field(default_factory=dict)
    ready_after: bool = False
    health_request: str = ""
    abort_lines: list[str] = field(default_factory=list)
    stub_restarts: list[str] = field(default_factory=list)  # server processes gone or replaced
    rss_growth_per_1k: dict[str, float | None] = field(default_factory=dict)  # after warm-up (first 10% out)
    rss_growth_per_1k_last_half: dict[str, float | None] = field(default_factory=dict)  # a plateau or a leak?
    process_died: str = ""  # "<label> (pid N) at T s": a watched process ended during the load
    samples: list[Sample] = field(default_factory=list)
    server_log: str | None = None
    conditions: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_blocks_at_idle(self) -> float | None:
        return self.idle.get("pagedserve:kv_blocks_used")

    @property
    def healthy(self) -> bool:
        return self.ready_after and self.health_request == "completed"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"kv_blocks_at_idle": self.kv_blocks_at_idle, "healthy": self.healthy}


def _local(address: str) -> str:
    host = address.split("://")[-1].rsplit(":", 1)[0]
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"soak: only localhost is allowed, got {address!r}")
    return address


def start_server(config: SoakConfig, workdir: Path) -> TritonServer:
    """tritonserver with the project's repository; stubs under PYTHONMALLOC=debug when asked.
    A shm-region prefix of its own, so /dev/shm usage counts this server's regions only."""
    repository = write_repository(workdir / "model_repository", engine=config.engine)
    server = TritonServer(
        repository, log_file=workdir / "tritonserver.log", workdir=workdir / "triton", exit_timeout_s=5,
        env=config.server_env | ({"PYTHONMALLOC": "debug"} if config.malloc_debug else {}),
        extra_args=[f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}soak{os.getpid()}_"],
    )
    return server.start(timeout=600)


def run_soak(config: SoakConfig, progress: bool = True) -> SoakReport:
    """Start (or attach to) the server, send the mix, watch, judge; the server started here is stopped."""
    workdir = Path(config.workdir or tempfile.mkdtemp(prefix="pagedserve-soak-"))
    server = None
    shm_prefix = SHM_PREFIX
    if config.url is None:
        server = start_server(config, workdir)
        url, http_url, metrics_url = server.grpc_url, server.http_url, server.metrics_url
        pgid, log_file = server.pid, str(server.log_file)
        shm_prefix = f"{SHM_PREFIX}soak{os.getpid()}_"
    else:
        url = _local(config.url)
        host, port = url.rsplit(":", 1)
        http_url = _local(config.http_url or f"{host}:8000")
        metrics_url = _local(config.metrics_url or f"http://{host}:8002/metrics")
        pid = config.server_pid or find_server_pid(int(port))
        pgid, log_file = (os.getpgid(pid) if pid else None), config.server_log
    try:
        report = _load(config, url, http_url.split("://")[-1], metrics_url, pgid, shm_prefix, progress)
    finally:
        if server is not None:
            server.stop()
    report.abort_lines = abort_lines(log_file)
    report.server_log = log_file
    return report


def _load(config: SoakConfig, url: str, http_url: str, metrics_url: str, pgid: int | None, shm_prefix: str,
          progress: bool) -> SoakReport:
    from tqdm.auto import tqdm

    mix = Mix(config.seed)
    report = SoakReport(config, conditions=conditions())
    outcomes: list[Outcome] = []
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    next_index = iter(range(config.num_requests))
    watcher = Watcher(pgid, shm_prefix, config.sample_interval, lambda: len(outcomes))
    first = watcher.sample()
    bar = tqdm(total=config.num_requests, desc=f"soak c={config.concurrency}", unit="req", disable=not progress)
    t0 = time.monotonic()

    fuzz_cases = fuzz_plan(config)

    def worker() -> None:
        while time.monotonic() - t0 < config.max_duration:
            if watcher.died_at is not None and not config.keep_going:
                return
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            if index in fuzz_cases:
                outcome = send_fuzz(url, index, fuzz_cases[index], config.fuzz_timeout)
            else:
                outcome = send(url, mix.request(index), config.final_timeout, lambda: watcher.died_at)
            if outcome.status == "error":
                watcher.check_alive()
            with lock:
                outcomes.append(outcome)
                counts[outcome.status] += 1
                bar.set_postfix(cancelled=counts["cancelled"], errors=counts["error"], lost=counts["lost"], refresh=False)
                bar.update(1)

    watcher.start()
    threads = [threading.Thread(target=worker, name=f"soak-{i}") for i in range(config.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    report.wall_s = time.monotonic() - t0
    report.conditions["loadavg_after"] = os.getloadavg()
    watcher.stopping.set()
    watcher.join()
    if watcher.died_at is not None:
        report.process_died = f"{watcher.died} at {watcher.died_at - t0:.0f} s"

    report.idle = idle_state(metrics_url, config.idle_timeout)
    watcher.sample()  # at idle
    report.ready_after = http_status(f"http://{http_url}/v2/health/ready") == 200
    check = send(url, SoakRequest(-1, "plain", "What is the capital of France?", {"max_tokens": 8, "temperature": 0.0}),
                 config.final_timeout)
    report.health_request = check.status if check.error is None else f"{check.status}: {check.error}"
    _tally(report, outcomes)
    report.samples = watcher.samples
    report.rss_growth_per_1k = rss_growth(watcher.samples, after=max(1, report.sent // 10))
    report.rss_growth_per_1k_last_half = rss_growth(watcher.samples, after=max(1, report.sent // 2))
    last = watcher.samples[-1]
    report.stub_restarts = [f"{label}: pid {pid} -> {last.pids.get(label)}" for label, pid in first.pids.items()
                            if last.pids.get(label) != pid]
    return report


def fuzz_plan(config: SoakConfig) -> dict[int, Any]:
    """Which requests are fuzz cases (seeded: the same for the same --seed), and which case each is."""
    if config.fuzz_share <= 0:
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.fuzz import draw_cases

    chosen = [i for i in range(config.num_requests) if random.Random(f"{config.seed}:{i}").random() < config.fuzz_share]
    return dict(zip(chosen, draw_cases(len(chosen), config.seed, gateway=False)))


def send_fuzz(url: str, index: int, case: Any, timeout: float) -> Outcome:
    """A fuzz case: a result is `completed`, an error naming its input `refused`; any other
    error (or no answer to a short request) is an error of the server."""
    from benchmarks.fuzz import send as fuzz_send

    answer = fuzz_send(case, url, None, budget_s=timeout)
    outcome = Outcome(index, "fuzz", request_id=f"fuzz {case.entry} {case.kind}")
    outcome.status = {"result": "completed", "named": "refused", "cancelled": "cancelled"}.get(answer.verdict, "error")
    if outcome.status == "error":
        outcome.error = f"fuzz {case.entry} {case.kind}: {answer.message[:200]}"
    return outcome


def _tally(report: SoakReport, outcomes: list[Outcome]) -> None:
    report.sent = len(outcomes)
    for o in outcomes:
        kind = report.by_kind.setdefault(o.kind, {})
        kind[o.status] = kind.get(o.status, 0) + 1
        if o.status == "lost":
            report.lost_finals.append(o.request_id)
        if o.error is not None:
            bucket = report.expected_errors if o.expected_error else report.errors
            bucket[o.error] = bucket.get(o.error, 0) + 1
        for problem in o.problems:
            if o.status != "lost":
                report.problems[problem] = report.problems.get(problem, 0) + 1
    report.completed = sum(o.status == "completed" for o in outcomes)
    report.cancelled = sum(o.status == "cancelled" for o in outcomes)
    report.e2e = Distribution.of([o.e2e for o in outcomes if o.e2e is not None])


def conditions() -> dict[str, Any]:
    """What the numbers depend on: CPU, its bf16 support, the load of other work, the code."""
    import subprocess

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=Path(__file__).parent).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    from pagedserve.backend.device import cpuinfo, native_bf16_flags

    text = cpuinfo()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "cpus": os.cpu_count(),
        "bf16_flags": native_bf16_flags(text),
        "loadavg_before": os.getloadavg(),
        "commit": run("git", "log", "--oneline", "-1").strip(),
        "uncommitted": [line for line in run("git", "status", "--porcelain").splitlines() if line.strip()],
    }


# --------------------------------------------------------------------------- the table


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_report(r: SoakReport) -> str:
    c = r.config
    lines = [
        f"soak: {r.sent} requests at concurrency {c.concurrency} in {r.wall_s:.0f} s, seed {c.seed}, "
        f"malloc-debug {'on' if c.malloc_debug else 'off'}",
        f"completed {r.completed}  cancelled {r.cancelled}  errors {sum(r.errors.values())}  "
        f"lost finals {len(r.lost_finals)}  output problems {sum(r.problems.values())}",
        "by kind: " + "; ".join(f"{k} {dict(sorted(v.items()))}" for k, v in sorted(r.by_kind.items())),
    ]
    if r.e2e and r.e2e.count:
        lines.append(f"E2E of completed requests (s): p50 {r.e2e.p50:.2f}  p99 {r.e2e.p99:.2f}  max {r.e2e.max:.2f}")
    for title, bucket in (("error", r.errors), ("expected error (cancelled)", r.expected_errors), ("problem", r.problems)):
        lines += [f"{title} x{n}: {message[:300]}" for message, n in sorted(bucket.items(), key=lambda kv: -kv[1])]
    lines += [f"lost final: {rid}" for rid in r.lost_finals[:20]]
    lines.append("at idle: " + "  ".join(f"{k} {v if v is not None else '-'}" for k, v in r.idle.items()))
    lines.append(f"healthy after the load: ready {r.ready_after}, one more request {r.health_request}")
    lines.append(f"stub aborts: {len(r.abort_lines)} log lines, {len(r.stub_restarts)} server processes gone or replaced")
    if r.process_died:
        lines.append(f"  died during the load: {r.process_died}" + ("" if c.keep_going else "; no new request after it"))
    lines += [f"  log: {line[:300]}" for line in r.abort_lines[:10]] + [f"  {s}" for s in r.stub_restarts]
    if r.samples:
        lines += _process_table(r)
    if r.conditions:
        k = r.conditions
        lines.append(f"machine: {k['cpu']}, {k['cpus']} CPUs, bf16 flags {' '.join(k['bf16_flags']) or 'none'}; "
                     f"load average before {k['loadavg_before'][0]:.1f}, after {k.get('loadavg_after', [0])[0]:.1f}")
        lines.append(f"code: {k['commit']}; uncommitted: {', '.join(k['uncommitted']) or 'none'}")
    if r.server_log:
        lines.append(f"server log: {r.server_log}")
    return "\n".join(lines)


def _process_table(r: SoakReport) -> list[str]:
    first, last = r.samples[0], r.samples[-1]
    warm = next((s for s in r.samples if s.done >= max(1, r.sent // 10)), last)
    lines = [f"{'process':<24}{'RSS MiB start':>14}{'warm':>8}{'end':>8}{'max':>8}{'MiB/1k req':>12}"
             f"{'last half':>11}{'threads':>9}{'max':>6}"]
    for label in sorted({label for s in r.samples for label in s.rss}) + ["total"]:
        rss = [sum(s.rss.values()) if label == "total" else s.rss[label] for s in r.samples if label in s.rss or label == "total"]
        threads = [sum(s.threads.values()) if label == "total" else s.threads[label] for s in r.samples
                   if label in s.threads or label == "total"]
        at = [sum(s.rss.values()) if label == "total" else s.rss.get(label) for s in (first, warm, last)]
        lines.append(f"{label:<24}{_mib(at[0]):>14}{_mib(at[1]):>8}{_mib(at[2]):>8}{_mib(max(rss)):>8}"
                     f"{_mib(r.rss_growth_per_1k.get(label)):>12}{_mib(r.rss_growth_per_1k_last_half.get(label)):>11}"
                     f"{threads[-1]:>9}{max(threads):>6}")
    lines.append(f"/dev/shm ({len(r.samples)} samples): files start {first.shm_files} end {last.shm_files} "
                 f"max {max(s.shm_files for s in r.samples)}; MiB start {_mib(first.shm_bytes)} end {_mib(last.shm_bytes)} "
                 f"max {_mib(max(s.shm_bytes for s in r.samples))}")
    return lines


def passed(r: SoakReport) -> bool:
    return (not r.lost_finals and not r.errors and not r.problems and not r.abort_lines and not r.stub_restarts
            and not r.process_died and r.kv_blocks_at_idle == 0 and r.healthy)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-duration", type=float, default=1500.0, help="no new request after this many seconds (default 1500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--final-timeout", type=float, default=300.0,
                   help="seconds within which a request must get its final response or an error (default 300)")
    p.add_argument("--sample-interval", type=float, default=10.0)
    p.add_argument("--malloc-debug", action="store_true", help="python stubs under PYTHONMALLOC=debug")
    p.add_argument("--keep-going", action="store_true", help="go on sending after a server process died (default: stop)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine parameter (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable of the server and its stubs (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--workdir", default=None, help="repository and server log go here (default: a temp dir, kept)")
    p.add_argument("--url", default=None, help="gRPC address of a running server on localhost (default: start one)")
    p.add_argument("--http-url", default=None, help="with --url: its HTTP address (default host:8000)")
    p.add_argument("--metrics-url", default=None, help="with --url: its metrics endpoint (default http://host:8002/metrics)")
    p.add_argument("--server-log", default=None, help="with --url: its log, searched for stub aborts")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: its pid (default: found by --grpc-port)")
    p.add_argument("--fuzz-share", type=float, default=0.0,
                   help="this share of the requests are benchmarks/fuzz.py cases (e.g. 0.05); default none")
    p.add_argument("--json-out", default=None)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = SoakConfig(
        num_requests=args.num_requests, concurrency=args.concurrency, max_duration=args.max_duration, seed=args.seed,
        final_timeout=args.final_timeout, sample_interval=args.sample_interval, malloc_debug=args.malloc_debug,
        keep_going=args.keep_going,
        url=args.url, http_url=args.http_url, metrics_url=args.metrics_url, server_log=args.server_log,
        server_pid=args.server_pid, engine=dict(kv.split("=", 1) for kv in args.set), workdir=args.workdir,
        server_env=dict(kv.split("=", 1) for kv in args.server_env), fuzz_share=args.fuzz_share,
    )
    print(f"soak on {platform.node()}: {config.num_requests} requests, concurrency {config.concurrency}", flush=True)
    report = run_soak(config, progress=not args.no_progress)
    print(format_report(report))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
