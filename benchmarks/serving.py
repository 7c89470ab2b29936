"""Serving benchmark, side by side in one run: pagedserve in-flight batching vs
pagedserve static batching (batches of 8) vs a naive transformers server (one request
at a time) vs vLLM's CPU build serving its own OpenAI-compatible server, all started by
this script on the same model, dtype and seeded workload, all measured by the same load
generator (client/loadgen/; the definitions of TTFT, ITL, TPOT and throughput are in the
docstring of client/loadgen/stats.py).

Reference, not a server: "offline" runs each closed-loop point's exact requests (same
token ids, output lengths, greedy, ignore_eos) through pagedserve's engine in-process
(LLMEngine.generate, every request queued at once) with max_num_seqs = the point's
concurrency, the batch limit the served run had. Served in-flight throughput over it is
what serving costs (the goal: >= 0.85); the report gives that ratio per concurrency, and
pagedserve / vLLM throughput and TTFT p99 wherever both ran.

Sweeps: closed loop at each concurrency (throughput under load), then open loop with
Poisson arrivals at each request rate (latency under a given load). Request i is the
same prompt and output length for every system and every point.

Workload (default): random-word prompts of 64-192 tokens (exact, checked with the
model's tokenizer), outputs of 32-96 tokens forced with ignore_eos, greedy, bfloat16.
Prefix caching is off in pagedserve: the sweep resends the same prompts at every
point, and cache hits from the previous point would flatter its TTFT.

Machines drift by 5-10% within minutes, so one point of each system can mislead about
their ratio: --rounds N measures every system N times, the order rotated each round, with
the servers kept up between their turns, and reports each round and the ratios' mean and
range (the offline reference reruns each round too).

On Linux it also reads where the cores went at pagedserve's closed-loop points
(core_accounting.py): the engine's CPU and its waits for a core, and each part's CPU per
output token (engine, response thread, other stub threads, tritonserver, load generator).

Writes its section of RESULTS.md (tables, plots, conditions) and the PNGs under plots/:

    python benchmarks/serving.py            # full sweep, ~30-45 min on 2 CPU cores
    python benchmarks/serving.py --quick    # a few minutes, results under a temp dir
    python benchmarks/serving.py --systems inflight,naive --concurrency 1,8 --rates 1
    python benchmarks/serving.py --systems inflight,static,naive,vllm,offline   # every system
    python benchmarks/serving.py --systems offline,inflight,inflight-http,vllm --concurrency 32 --rates "" --rounds 3

pagedserve is driven over gRPC streaming (--pagedserve-protocol http for Triton's
generate_stream); the system "inflight-http" is the in-flight engine again (the same
tritonserver, through its HTTP port), driven over generate_stream (SSE through aiohttp, the
client technology vLLM is measured with), so one run shows both clients side by side: on
2 cores the gRPC client's own CPU per streamed token (tritonclient.grpc.aio) is part of
what the served number loses. The naive server only speaks HTTP/SSE
(benchmarks/naive_server.py); vLLM is driven over /v1/completions (SSE). vLLM runs from
its own venv: set it up once with `python benchmarks/peers/vllm_cpu.py --setup`; without it
that system fails with that command and the others run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from core_accounting import PARTS, CoreUse, CoreWindow, busy_cores
from peers import vllm_cpu

from pagedserve.client.loadgen import (BenchConfig, BenchResult, RequestRecord, Summary, Workload, load_workload,
                                       measured_requests, run_benchmark_async, summarize)
from pagedserve.client.repository import write_repository
from pagedserve.client.process import ServerProcess, free_port, http_status
from pagedserve.client.triton_server import TritonServer

HERE = Path(__file__).resolve().parent

SYSTEM_NAMES = {
    "inflight": "pagedserve in-flight batching",
    "inflight-http": "pagedserve in-flight batching, HTTP generate_stream",
    "static": "pagedserve static batching (8)",
    "naive": "naive transformers server",
    "vllm": f"vLLM-CPU {vllm_cpu.VERSION} (its OpenAI server)",
    "offline": "pagedserve offline (in-process, same requests)",
}
COLORS = {"inflight": "tab:blue", "inflight-http": "tab:cyan", "static": "tab:orange", "naive": "tab:red", "vllm": "tab:green", "offline": "tab:gray"}
LOCAL_SERVERS = ("naive", "vllm")
"""Systems that are not tritonserver with our model repository."""
PROTOCOLS = {"naive": "http", "vllm": "openai", "inflight-http": "http"}
"""How the load generator talks to each system whose protocol is fixed (the others: --pagedserve-protocol)."""
SERVED = {"inflight": "", "inflight-http": " (HTTP generate_stream)"}
"""The in-flight engine served, one system per client protocol: how its reference lines are labelled."""


@dataclass
class Point:
    """One measured sweep point."""

    system: str  # key of SYSTEM_NAMES
    mode: str  # "closed" (load = concurrency) or "open" (load = requests/s)
    load: float
    summary: Summary
    wall_s: float
    round: int = 1
    """Which of the run's rounds (--rounds) measured it."""
    cores: CoreUse | None = None
    """Where the cores went while it ran (pagedserve's points, closed loop, on Linux)."""


@dataclass
class SystemRun:
    system: str
    points: list[Point] = field(default_factory=list)
    startup_s: float = 0.0
    loadavg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    failure: str | None = None
    incidents: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- systems


class LocalServer:
    """A server subprocess on 127.0.0.1:`port`, ready when GET `ready_path` answers 200:
    the naive server and vLLM's, which (unlike tritonserver) have no wrapper of their own."""

    def __init__(self, process: ServerProcess, port: int, ready_path: str):
        self.process, self.port, self.ready_path = process, port, ready_path

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> str | os.PathLike[str] | None:
        return self.process.log_file

    def start(self, timeout: float = 600) -> None:
        ready_url = f"http://{self.url}{self.ready_path}"
        self.process.start()
        self.process.wait_ready(lambda: http_status(ready_url) == 200, time.monotonic() + timeout, poll_s=0.5)

    def stop(self) -> None:
        """SIGTERM, then the whole process group (vLLM's engine core is a child)."""
        self.process.stop(timeout=20)


def local_server(system: str, dtype: str, logs: Path, stream_interval: int) -> LocalServer:
    """The naive server (benchmarks/naive_server.py) or vLLM's (benchmarks/peers/vllm_cpu.py), not started."""
    port = free_port()
    if system == "vllm":
        process = vllm_cpu.server_process(dtype, port, logs / "vllm_server.log", stream_interval=stream_interval)
        return LocalServer(process, port, vllm_cpu.READY_PATH)
    command = [sys.executable, str(HERE / "naive_server.py"), "--port", str(port), "--dtype", dtype]
    return LocalServer(ServerProcess(command, logs / "naive_server.log", name="naive server"), port, "/v2/health/ready")


def engine_settings(system: str, dtype: str, stream_interval: int) -> dict[str, str]:
    """pagedserve engine parameters for a system (the in-flight engine keeps its defaults)."""
    settings = {"dtype": dtype, "enable_prefix_caching": "false", "stream_interval": str(stream_interval)}
    if system == "static":
        settings |= {"scheduling_policy": "static", "max_num_seqs": "8"}
    return settings


# --------------------------------------------------------------------------- the sweep


def server_key(system: str, args: argparse.Namespace) -> str:
    """Systems with the same key are measured on one server: the in-flight engine over
    gRPC and over HTTP is one tritonserver, asked through its two ports."""
    if system in LOCAL_SERVERS:
        return system
    return "pagedserve " + json.dumps(engine_settings(system, args.dtype, args.stream_interval), sort_keys=True)


class Target:
    """One server, restartable: a crashed server is replaced by a fresh one. `system`: the
    first system measured on it (it names the logs and, for the local servers, the server)."""

    def __init__(self, system: str, args: argparse.Namespace, workdir: Path):
        self.system, self.args, self.workdir = system, args, workdir
        self.server: TritonServer | LocalServer | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.server is not None

    def start(self) -> None:
        """Start a fresh server."""
        self.starts += 1
        logs = self.workdir / f"{self.system}-{self.starts}"
        logs.mkdir(parents=True, exist_ok=True)
        if self.system in LOCAL_SERVERS:
            server = self.server = local_server(self.system, self.args.dtype, logs, self.args.stream_interval)
            server.start(timeout=600)
            return
        settings = engine_settings(self.system, self.args.dtype, self.args.stream_interval)
        repository = write_repository(logs / "model_repository", engine=settings)
        triton = TritonServer(repository, log_file=logs / "tritonserver.log", exit_timeout_s=5, workdir=logs / "triton")
        self.server = triton
        triton.start(timeout=600)

    def url(self, protocol: str) -> str:
        """Its address for the load generator speaking `protocol`."""
        if isinstance(self.server, TritonServer):
            return self.server.grpc_url if protocol == "grpc" else self.server.http_url
        assert self.server is not None, "start the server first"
        return self.server.url

    def crash_lines(self) -> list[str]:
        """Signs in the server log that a process died (e.g. a python stub's heap corruption)."""
        if self.server is None:
            return []
        try:
            text = Path(self.server.log_file or "").read_text(errors="replace")
        except OSError:
            return []
        return [line.strip() for line in text.splitlines() if _CRASH.search(line)][-3:]

    def stop(self) -> None:
        if isinstance(self.server, TritonServer):
            self.server.cleanup()
        elif self.server is not None:
            self.server.stop()
        self.server = None


_CRASH = re.compile(r"malloc\(\)|double free|corrupted|Segmentation fault|segfault|core dumped|Stub process .* (unhealthy|not healthy)|Traceback")


def round_order(systems: list[str], round_number: int) -> list[str]:
    """Round k runs the systems rotated by k - 1, so over the rounds each system runs early
    and late alike, and drift of the machine within a run falls on all of them."""
    shift = (round_number - 1) % len(systems) if systems else 0
    return systems[shift:] + systems[:shift]


def run_sweep(args: argparse.Namespace, workload: Workload, workdir: Path, report: Callable[[str], None],
              raw: list[dict[str, Any]] | None = None) -> list[SystemRun]:
    """Every system's points, `args.rounds` times. A server starts at its first system's turn
    and stops after its last use: with one round, a server is up only while its systems run
    (inflight and inflight-http share one); with more, the servers stay up, idle between
    their turns, so every round measures the same warm servers."""
    runs = {system: SystemRun(system) for system in args.systems}
    schedule = [(r, system) for r in range(1, args.rounds + 1) for system in round_order(args.systems, r)]
    keys = {system: server_key(system, args) for system in args.systems if system != "offline"}
    last_use = {keys[system]: i for i, (_, system) in enumerate(schedule) if system in keys}
    targets: dict[str, Target] = {}
    try:
        for i, (round_number, system) in enumerate(schedule):
            run = runs[system]
            if run.failure:
                continue
            if not run.points:
                run.loadavg_before = os.getloadavg()
            if args.rounds > 1:
                report(f"[{system}] round {round_number} of {args.rounds}")
            wait_until_quiet(system, report)
            if system == "offline":
                run_offline_reference(args, workload, run, round_number, report, raw)
            else:
                target = targets.setdefault(keys[system], Target(system, args, workdir))
                run_points(run, target, round_number, args, workload, report, raw)
                if last_use[keys[system]] == i:
                    target.stop()
            run.loadavg_after = os.getloadavg()
    finally:
        for target in targets.values():
            target.stop()
    return list(runs.values())


def wait_until_quiet(system: str, report: Callable[[str], None], most_cores: float = 0.25,
                     longest_s: float = 20.0) -> float | None:
    """Before a system's turn, wait for the last one's work to end: vLLM's offline engine keeps a
    core spinning ~1 s after each generate (its OpenMP workers), which the next system would pay
    for. Gives up after `longest_s`, saying so; returns the busy cores last seen (None off Linux)."""
    deadline = time.monotonic() + longest_s
    busy = busy_cores()
    while busy is not None and busy > most_cores and time.monotonic() < deadline:
        busy = busy_cores()
    if busy is not None and busy > most_cores:
        report(f"[{system}] the machine stayed busy ({busy:.2f} cores) for {longest_s:.0f} s; measuring anyway")
    return busy


def run_points(run: SystemRun, target: Target, round_number: int, args: argparse.Namespace, workload: Workload,
               report: Callable[[str], None], raw: list[dict[str, Any]] | None) -> None:
    """One round of a system's sweep points on its server (started here if it is not up).

    A point with failed requests is run once more on a freshly started server (a crashed
    server would otherwise fail every later point); both attempts are reported. With
    `raw`, every kept point's full result (request records included) is appended to it.
    A server that does not start, or a restart that fails, ends the system's run.
    """
    system = run.system
    protocol = PROTOCOLS.get(system, args.pagedserve_protocol)
    warm = False  # each system's first point of a round sends the warm-up requests
    if not target.running:
        report(f"[{system}] starting {SYSTEM_NAMES[system]} ...")
        started = time.perf_counter()
        try:
            target.start()
        except Exception as exc:  # noqa: BLE001 (the other systems still run)
            run.failure = f"did not start: {exc}"
            report(f"[{system}] {run.failure}")
            target.stop()
            return
        run.startup_s = time.perf_counter() - started
        report(f"[{system}] ready in {run.startup_s:.0f} s at {target.url(protocol)} ({protocol})")
    try:
        plan = [("closed", float(c)) for c in args.concurrency] + [("open", r) for r in args.rates]
        for mode, load in plan:
            for attempt in (1, 2):
                config = point_config(mode, load, args, target.url(protocol), protocol, warmup=0 if warm else args.warmup)
                warm = True
                window = core_window(target, mode)
                t = time.perf_counter()
                result = asyncio.run(run_benchmark_async(config, workload, progress=args.progress,
                                                         on_measured_start=window and window.start))
                point = Point(system, mode, load, result.summary, time.perf_counter() - t, round_number,
                              window and window.stop())
                report(f"[{system}] {describe(point)}")
                if not result.summary.num_errors or attempt == 2:
                    break
                crash = target.crash_lines()
                incident = (f"{describe_load(point)}: {result.summary.num_errors} of {result.summary.num_requests} requests "
                            f"failed ({'; '.join(result.summary.error_examples[:2])})"
                            + (f"; server log: {' | '.join(crash)}" if crash else "")
                            + "; re-run on a fresh server")
                run.incidents.append(incident)
                report(f"[{system}] {incident}")
                target.stop()
                target.start()
                warm = False
            run.points.append(point)
            if raw is not None:
                raw.append({"system": system, "mode": mode, "load": load, "round": round_number} | result.to_json())
    except Exception as exc:  # noqa: BLE001 (a restart that failed: keep what was measured)
        run.failure = f"stopped early: {type(exc).__name__}: {exc}"
        report(f"[{system}] {run.failure}")
        target.stop()


def core_window(target: Target, mode: str) -> CoreWindow | None:
    """A CoreWindow over the load generator and a pagedserve server (closed loop only)."""
    if mode != "closed" or not isinstance(target.server, TritonServer) or target.server.pid is None or not CoreWindow.supported():
        return None
    return CoreWindow(target.server.pid, "load generator")


def point_config(mode: str, load: float, args: argparse.Namespace, url: str = "", protocol: str = "grpc",
                 warmup: int = 0) -> BenchConfig:
    """The load generator's settings at one sweep point; the offline reference takes its
    requests from the same settings, so it runs exactly what the servers were sent."""
    return BenchConfig(
        url=url, protocol=protocol, model_name="llm", num_requests=requests_for(mode, load, args),
        concurrency=int(load) if mode == "closed" else 1, request_rate=load if mode == "open" else None,
        prompt_len_mean=args.prompt_len_mean, prompt_len_range=args.prompt_len_range,
        output_len=args.output_len, output_len_range=args.output_len_range,
        seed=args.seed, warmup=warmup, request_timeout=args.request_timeout,
    )


def run_offline_reference(args: argparse.Namespace, workload: Workload, run: SystemRun, round_number: int,
                          report: Callable[[str], None], raw: list[dict[str, Any]] | None = None) -> None:
    """Each closed-loop point's requests through pagedserve's engine in-process
    (offline_throughput.run_pagedserve: warm-up, then one LLMEngine.generate of them all,
    prefix caching off) with max_num_seqs = the concurrency: the throughput the served
    engine would have without Triton, the transport and the client. No per-request
    timings (every request is queued at once), so its latency columns stay empty."""
    from offline_throughput import run_pagedserve
    from workload import WorkItem

    from pagedserve.backend.model_files import default_model_path
    from pagedserve.backend.tokenizer import encode_prompt, load_tokenizer

    report(f"[offline] {SYSTEM_NAMES['offline']}: closed-loop points only")
    tokenizer = load_tokenizer(default_model_path())  # the one the served model encodes prompts with
    try:
        for concurrency in args.concurrency:
            config = point_config("closed", concurrency, args)
            specs = measured_requests(config, workload)
            work = [WorkItem(encode_prompt(tokenizer, spec.prompt), spec.max_tokens) for spec in specs]
            t = time.perf_counter()
            row = run_pagedserve(work, args.dtype, "inflight", batch=concurrency, progress=args.progress,
                                 cores=CoreWindow(None, "engine") if CoreWindow.supported() else None,
                                 stream_interval=args.stream_interval)
            records = [RequestRecord(spec.index, 0.0, 0.0, end=row.seconds, prompt_tokens=len(item.prompt_token_ids),
                                     output_tokens=item.output_len, requested_output_tokens=item.output_len)
                       for spec, item in zip(specs, work)]
            point = Point("offline", "closed", float(concurrency), summarize(records), time.perf_counter() - t, round_number,
                          row.cores)
            run.points.append(point)
            report(f"[offline] {describe(point)}")
            if raw is not None:
                raw.append({"system": "offline", "mode": "closed", "load": point.load, "round": round_number}
                           | BenchResult(config, point.summary, records).to_json())
    except Exception as exc:  # noqa: BLE001 (keep what was measured; the servers still run)
        run.failure = f"stopped early: {type(exc).__name__}: {exc}"
        report(f"[offline] {run.failure}")


def requests_for(mode: str, load: float, args: argparse.Namespace) -> int:
    """Closed loop: enough requests that every slot is refilled a few times."""
    if mode == "closed":
        return max(args.min_requests, int(args.requests_per_slot * load))
    return args.rate_requests


def describe_load(point: Point) -> str:
    return f"concurrency {point.load:g}" if point.mode == "closed" else f"{point.load:g} req/s"


def describe(point: Point) -> str:
    s = point.summary
    return (f"{describe_load(point)}: {s.num_ok}/{s.num_requests} ok, {s.output_tokens_per_s:.1f} out tok/s, {s.requests_per_s:.2f} req/s, "
            f"TTFT p50 {_s(s.ttft.p50)} p99 {_s(s.ttft.p99)}, TPOT p50 {_ms(s.tpot.p50)} ms ({point.wall_s:.0f} s)")


# --------------------------------------------------------------------------- report


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _sec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(runs: list[SystemRun], mode: str) -> list[str]:
    load = "concurrency" if mode == "closed" else "rate (req/s)"
    several = len(rounds_of(runs)) > 1
    lines = [
        f"| system | {load} | requests | errors | output tok/s | req/s | TTFT p50 (s) | TTFT p99 (s) | "
        "ITL p50 (ms) | ITL p99 (ms) | TPOT p50 (ms) | E2E p50 (s) | E2E p99 (s) | client CPU (us/response) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        for p in (p for p in run.points if p.mode == mode):
            s = p.summary
            name = SYSTEM_NAMES[p.system] + (f", round {p.round}" if several else "")
            lines.append(
                f"| {name} | {p.load:g} | {s.num_requests} | {s.num_errors} | {s.output_tokens_per_s:.1f} | "
                f"{s.requests_per_s:.2f} | {_sec(s.ttft.p50)} | {_sec(s.ttft.p99)} | {_ms(s.itl.p50)} | {_ms(s.itl.p99)} | "
                f"{_ms(s.tpot.p50)} | {_sec(s.e2e.p50)} | {_sec(s.e2e.p99)} | {_us(s.client_cpu_per_response_us)} |"
            )
    return lines


def core_table(runs: list[SystemRun]) -> list[str]:
    """Where the cores went at each closed-loop point of pagedserve (served and offline): the
    engine's threads' CPU and their time waiting for a core, in cores, and every part's CPU per
    output token. Equal engine CPU per token served and offline means the served loss is the
    other parts' CPU, not slower engine work."""
    points = [p for run in runs for p in run.points if p.cores is not None and p.summary.total_output_tokens]
    if not points:
        return []
    several = len(rounds_of(runs)) > 1
    lines = [
        "### Where the cores went (closed loop)", "",
        "Over each point's measured requests (warm-up excluded), every thread's CPU and its time runnable but waiting "
        "for a core (Linux schedstat): the engine is the engine thread and its OpenMP workers (served) or the "
        "benchmark's process (offline), in cores (1.0: one core all the time); then each part's CPU per output "
        "token, in microseconds.", "",
        "| system | concurrency | output tok/s | engine CPU (cores) | engine waiting for a core (cores) | "
        + " | ".join(f"{part} (us/token)" for part in PARTS) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(PARTS),
    ]
    for p in points:
        cores, tokens = p.cores, p.summary.total_output_tokens
        name = SYSTEM_NAMES[p.system] + (f", round {p.round}" if several else "")
        per_token = " | ".join(_us(cores.us_per(part, tokens)) if part in cores.parts else "-" for part in PARTS)
        lines.append(f"| {name} | {p.load:g} | {p.summary.output_tokens_per_s:.1f} | {cores.cores('engine'):.2f} | "
                     f"{cores.waiting_cores('engine'):.2f} | {per_token} |")
    return lines + [""]


def plot(runs: list[SystemRun], plots_dir: Path) -> dict[str, Path]:
    """Throughput vs concurrency, TPOT vs concurrency, TTFT p50/p99 vs request rate (means over the rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def closed(run: SystemRun) -> list[Point]:
        return [p for p in run.points if p.mode == "closed"]

    def opened(run: SystemRun) -> list[Point]:
        return [p for p in run.points if p.mode == "open"]

    def versus_concurrency(name: str, value: Callable[[Summary], float | None], ylabel: str, title: str) -> None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run in runs:
            means = mean_by_load(closed(run), value)
            if means:
                ax.plot(list(means), list(means.values()), "o--" if run.system == "offline" else "o-",
                        color=COLORS[run.system], label=SYSTEM_NAMES[run.system])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p.load for r in runs for p in closed(r)}) or [1])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        paths[name] = plots_dir / f"serving_{name}_vs_concurrency.png"
        fig.savefig(paths[name], dpi=120)
        plt.close(fig)

    versus_concurrency("throughput", lambda s: s.output_tokens_per_s, "output tokens/s", "Throughput under load")
    versus_concurrency("tpot", lambda s: None if s.tpot.p50 is None else s.tpot.p50 * 1000, "TPOT p50 (ms)",
                       "Time per output token under load")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        p50, p99 = (mean_by_load(opened(run), lambda s, q=q: getattr(s.ttft, q)) for q in ("p50", "p99"))
        if p50:
            ax.plot(list(p50), list(p50.values()), "o-", color=COLORS[run.system], label=f"{SYSTEM_NAMES[run.system]} p50")
            ax.plot(list(p99), list(p99.values()), "s--", color=COLORS[run.system], label=f"{SYSTEM_NAMES[run.system]} p99")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("request rate (req/s, Poisson arrivals)")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title("TTFT vs request rate")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # no open-loop points (--rates "")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths["ttft"] = plots_dir / "serving_ttft_vs_rate.png"
    fig.savefig(paths["ttft"], dpi=120)
    plt.close(fig)
    return paths


def conditions(args: argparse.Namespace, runs: list[SystemRun], started: datetime.datetime, minutes: float) -> list[str]:
    import torch

    loads = ", ".join(
        f"{r.system} {r.loadavg_before[0]:.1f} -> {r.loadavg_after[0]:.1f}" for r in runs
    )
    return [
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}; client, server and load generator "
        f"share the machine. Run {started:%Y-%m-%d %H:%M}, {minutes:.0f} min in all.",
        f"1-minute load average before -> after each system: {loads} (other work on a shared machine shows up here).",
        f"Workload: seeded (seed {args.seed}), prompts {args.prompt_len_mean - args.prompt_len_range}-"
        f"{args.prompt_len_mean + args.prompt_len_range} tokens (random words, exact counts), outputs "
        f"{args.output_len - args.output_len_range}-{args.output_len + args.output_len_range} tokens forced with "
        f"ignore_eos, greedy, {args.dtype}, model SmolLM2-135M-Instruct. Closed loop: max({args.min_requests}, "
        f"{args.requests_per_slot:g} x concurrency) requests per point; open loop: {args.rate_requests} requests per rate. "
        f"{args.warmup} warm-up requests per system and round (not measured)."
        + (f" {args.rounds} rounds, the systems' order rotated each round, servers kept up between rounds."
           if args.rounds > 1 else ""),
        f"Stream interval {args.stream_interval} (tokens per streamed response; pagedserve's stream_interval, vLLM's "
        f"--stream-interval{', both defaults' if args.stream_interval == 1 else ''}).",
        f"pagedserve: default engine settings except dtype and enable_prefix_caching=false; static: scheduling_policy=static, "
        f"max_num_seqs=8; driven over {args.pagedserve_protocol}; inflight-http: the in-flight engine driven over "
        f"Triton's HTTP generate_stream (SSE, aiohttp). Naive: benchmarks/naive_server.py (transformers "
        f"generate, one request at a time, SSE over HTTP).",
    ] + [line for system, line in REFERENCE_CONDITIONS.items() if system in args.systems]


REFERENCE_CONDITIONS = {
    "vllm": f"vLLM-CPU {vllm_cpu.VERSION}: its OpenAI-compatible server from its own venv (benchmarks/peers/vllm_cpu.py), "
            "the bundled model as a Hugging Face directory, --max-model-len 1024 --no-enable-prefix-caching, other "
            "settings its defaults, its CPU environment (KV space, cores bound, tcmalloc + Intel OpenMP); driven over "
            "/v1/completions (SSE) with ignore_eos and temperature 0.",
    "offline": "Offline: each closed-loop point's requests as token ids through LLMEngine.generate in the benchmark's "
               "process (all queued at once, max_num_seqs = the concurrency, prefix caching off, KV for the whole "
               "workload: no preemption); throughput only.",
}
"""Conditions lines of the references (vLLM, the offline engine), when they ran."""


def write_report(path: Path, runs: list[SystemRun], plots: dict[str, Path], lines: list[str]) -> None:
    rel = {k: os.path.relpath(v, path.parent) for k, v in plots.items()}
    out = ["## Serving under load (Triton server, streaming clients)", "",
           "`python benchmarks/serving.py` (one run, all systems side by side; `pagedserve bench` is the same load "
           "generator for one point). TTFT: request sent to first token; ITL: gap between streamed tokens; TPOT: "
           "(E2E - TTFT) / (output tokens - 1) per request; throughput: output tokens of successful requests over "
           "first-send-to-last-finish; client CPU: the load generator's process CPU per token-bearing response (the "
           "client shares the machine's cores with the server).", ""]
    out += [f"{line}" for line in lines] + [""]
    for run in runs:
        if run.failure:
            out.append(f"**{SYSTEM_NAMES[run.system]}: {run.failure}**")
            out.append("")
        for incident in run.incidents:
            out.append(f"- {SYSTEM_NAMES[run.system]}, {incident}.")
    if any(run.incidents for run in runs):
        out.append("")
    out += ["### Closed loop: throughput and latency vs concurrency", ""] + table(runs, "closed") + [""]
    out += [f"![throughput vs concurrency]({rel['throughput']})", "", f"![TPOT vs concurrency]({rel['tpot']})", ""]
    if any(p.mode == "open" for run in runs for p in run.points):
        out += ["### Open loop: Poisson arrivals", ""] + table(runs, "open") + [""]
        out += [f"![TTFT vs request rate]({rel['ttft']})", ""]
    out += headline(runs) + references(runs) + core_table(runs)
    replace_section(path, "\n".join(out).rstrip())


BEGIN, END = "<!-- serving.py: begin -->", "<!-- serving.py: end -->"


def replace_section(path: Path, text: str) -> None:
    """Put `text` between this script's markers in `path` (appended the first time), so
    a re-run updates its own section of RESULTS.md and leaves the others alone."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def rounds_of(runs: list[SystemRun]) -> list[int]:
    return sorted({p.round for run in runs for p in run.points})


def closed_points(runs: list[SystemRun], round_number: int) -> dict[str, dict[float, Summary]]:
    """Each system's closed-loop summaries of one round, by concurrency."""
    return {r.system: {p.load: p.summary for p in r.points if p.mode == "closed" and p.round == round_number}
            for r in runs if r.points}


def mean_by_load(points: list[Point], value: Callable[[Summary], float | None]) -> dict[float, float]:
    """`value` of each load's points averaged over the rounds (points without it left out)."""
    values: dict[float, list[float]] = {}
    for p in points:
        v = value(p.summary)
        if v is not None:
            values.setdefault(p.load, []).append(v)
    return {load: sum(vs) / len(vs) for load, vs in sorted(values.items())}


def headline(runs: list[SystemRun]) -> list[str]:
    """Throughput ratios at the highest concurrency every server reached (means over the
    rounds; the offline reference has its own lines: references())."""
    by = {r.system: mean_by_load([p for p in r.points if p.mode == "closed"], lambda s: s.output_tokens_per_s)
          for r in runs if r.points and r.system != "offline"}
    if "inflight" not in by:
        return []
    common = set(by["inflight"])
    for points in by.values():
        common &= set(points)
    if not common:
        return []
    top = max(common)
    best = by["inflight"][top]
    parts = [f"{SYSTEM_NAMES[s]} {best / points[top]:.1f}x" for s, points in by.items() if s != "inflight" and points[top] > 0]
    if not parts:
        return []
    mean = " (mean of the rounds)" if len(rounds_of(runs)) > 1 else ""
    return [f"At concurrency {top:g}, in-flight batching delivers {best:.0f} output tok/s{mean}: vs " + ", vs ".join(parts) + ".", ""]


@dataclass
class Ratios:
    """One served system at one concurrency in one round, over the references that ran beside it."""

    served_over_offline: float | None
    over_vllm: float | None
    ttft_p99_over_vllm: float | None


def ratios(s: Summary, offline: Summary | None, vllm: Summary | None) -> Ratios:
    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return Ratios(over(s.output_tokens_per_s, offline and offline.output_tokens_per_s),
                  over(s.output_tokens_per_s, vllm and vllm.output_tokens_per_s),
                  over(s.ttft.p99, vllm and vllm.ttft.p99))


def references(runs: list[SystemRun]) -> list[str]:
    """A line per served system, concurrency and round: served in-flight over offline
    throughput (the goal is >= 0.85), and pagedserve in-flight over vLLM in throughput and
    TTFT p99; with several rounds, then each ratio's mean and range over the rounds."""
    rounds = rounds_of(runs)
    lines, spread = [], {}
    for round_number in rounds:
        by = closed_points(runs, round_number)
        offline, vllm = by.get("offline", {}), by.get("vllm", {})
        for system, label in SERVED.items():
            for load, s in sorted(by.get(system, {}).items()):
                o, v = offline.get(load), vllm.get(load)
                r = ratios(s, o, v)
                spread.setdefault((system, load), []).append(r)
                parts = []
                if r.served_over_offline is not None:
                    parts.append(f"served / offline {r.served_over_offline:.3f} ({s.output_tokens_per_s:.0f} vs "
                                 f"{o.output_tokens_per_s:.0f} tok/s)")
                if r.over_vllm is not None:
                    ttft = "" if r.ttft_p99_over_vllm is None else f", TTFT p99 {r.ttft_p99_over_vllm:.2f}x"
                    parts.append(f"pagedserve / vLLM throughput {r.over_vllm:.2f}x{ttft}")
                if parts:
                    at = f", round {round_number}" if len(rounds) > 1 else ""
                    lines.append(f"- concurrency {load:g}{label}{at}: " + "; ".join(parts) + ".")
    if not lines:
        return []
    out = ["In-flight batching served, per concurrency: over the offline engine on the same requests (goal >= 0.85) "
           "and over vLLM-CPU (throughput above 1x: pagedserve faster; TTFT above 1x: pagedserve slower).", ""] + lines + [""]
    if len(rounds) > 1:
        out += [f"Over the {len(rounds)} rounds (mean, lowest-highest):", ""]
        for (system, load), rs in spread.items():
            parts = [f"{name} {_range([getattr(r, field) for r in rs], digits)}" for name, field, digits in (
                ("served / offline", "served_over_offline", 3), ("pagedserve / vLLM throughput", "over_vllm", 2),
                ("TTFT p99 vs vLLM", "ttft_p99_over_vllm", 2)) if any(getattr(r, field) is not None for r in rs)]
            if parts:
                out.append(f"- concurrency {load:g}{SERVED[system]}: " + "; ".join(parts) + ".")
        out.append("")
    return out


def _range(values: list[float | None], digits: int) -> str:
    """Mean (lowest-highest, count); served / offline gets three digits: 0.848 is not the goal's 0.85."""
    present = [v for v in values if v is not None]
    return f"{sum(present) / len(present):.{digits}f} ({min(present):.{digits}f}-{max(present):.{digits}f}, {len(present)} rounds)"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few minutes: fewer points, fewer and shorter requests")
    parser.add_argument("--systems", default="inflight,static,naive",
                        help="comma list of inflight, inflight-http, static, naive, vllm, offline (closed loop only)")
    parser.add_argument("--concurrency", default=None, help="closed-loop levels (default 1,2,4,8,16,32)")
    parser.add_argument("--rates", default=None, help="open-loop request rates in req/s (default 0.25,0.5,1,2)")
    parser.add_argument("--min-requests", type=int, default=None, help="closed loop: at least this many requests (default 16)")
    parser.add_argument("--requests-per-slot", type=float, default=None, help="closed loop: requests per concurrent slot (default 2)")
    parser.add_argument("--rate-requests", type=int, default=None, help="open loop: requests per rate (default 24)")
    parser.add_argument("--prompt-len-mean", type=int, default=None, help="default 128 (quick: 64)")
    parser.add_argument("--prompt-len-range", type=int, default=None, help="default 64 (quick: 32)")
    parser.add_argument("--output-len", type=int, default=None, help="default 64 (quick: 32)")
    parser.add_argument("--output-len-range", type=int, default=None, help="default 32 (quick: 16)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests when a system starts")
    parser.add_argument("--pagedserve-protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens gathered per streamed response, for pagedserve (stream_interval, the offline "
                             "reference too) and vLLM (--stream-interval) alike; 1 (both defaults) streams each token")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every system's points this many times, the systems' order rotated each round "
                             "and their servers kept up between rounds; the report gives each round and the ratios' "
                             "mean and range (default 1)")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take before it counts as failed (default 300)")
    parser.add_argument("--out-dir", default=None,
                        help="where RESULTS.md (its serving section) and plots/ go (default: benchmarks/, with --quick a temp dir)")
    parser.add_argument("--json-out", default=None, help="also write every point's summary and request records here")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no per-point progress bars")
    args = parser.parse_args(argv)

    full = dict(concurrency="1,2,4,8,16,32", rates="0.25,0.5,1,2", min_requests=16, requests_per_slot=2.0,
                rate_requests=24, prompt_len_mean=128, prompt_len_range=64, output_len=64, output_len_range=32)
    quick = dict(concurrency="1,4,16", rates="0.5,2", min_requests=4, requests_per_slot=1.0,
                 rate_requests=8, prompt_len_mean=64, prompt_len_range=32, output_len=32, output_len_range=16)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEM_NAMES)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEM_NAMES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.stream_interval < 1:
        parser.error(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.out_dir is None:
        args.out_dir = tempfile.mkdtemp(prefix="pagedserve-serving-quick-") if args.quick else str(HERE)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    started, t0 = datetime.datetime.now(), time.perf_counter()

    def report(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    # One workload object for every point and system: same prompts, tokenizer loaded once.
    workload = load_workload(BenchConfig(
        prompt_len_mean=args.prompt_len_mean, prompt_len_range=args.prompt_len_range,
        output_len=args.output_len, output_len_range=args.output_len_range, seed=args.seed))
    raw: list[dict[str, Any]] | None = [] if args.json_out else None
    points = len(args.concurrency) + len(args.rates)
    rounds = f", {args.rounds} rounds" if args.rounds > 1 else ""
    report(f"systems {', '.join(args.systems)}; {points} points each{rounds}; results to {out_dir}")
    with tempfile.TemporaryDirectory(prefix="pagedserve-serving-") as tmp:
        runs = run_sweep(args, workload, Path(tmp), report, raw)
    minutes = (time.perf_counter() - t0) / 60
    plots = plot(runs, out_dir / "plots")
    results = out_dir / "RESULTS.md"
    write_report(results, runs, plots, conditions(args, runs, started, minutes))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": [asdict(r) for r in runs], "raw": raw}) + "\n")
    print("\n" + results.read_text().split(BEGIN)[1].split(END)[0])
    report(f"wrote {results} and {', '.join(str(p) for p in plots.values())}")
    return 1 if any(r.failure for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
