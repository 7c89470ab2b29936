"""Kill cycles: a client process holding many streams dies with SIGKILL, again and
again; then the server is stopped with streams in flight.

    python benchmarks/kill_cycles.py                       # 20 gRPC + 20 HTTP SSE cycles, 32 streams
    python benchmarks/kill_cycles.py --transports http --cycles 5 --streams 16

Each cycle: a child process (this script with --hold) opens N streams to `llm`, each
asking for a long output (gRPC: one client and stream per request; HTTP: one
`generate_stream` connection per request). Once every stream has had its first
response, the child is killed with SIGKILL, so the server sees N connections vanish
at once (the mass cancellation that crashes Triton's gRPC frontend in some releases:
server#7840, #8078). The parent then waits until the engine is idle, checks that
tritonserver still runs, is ready and answers a request, and that no python stub died.

Last, N streams are started once more and the server is stopped (SIGINT). Triton 2.51
tells a python model nothing before unloading it, and keeps it loaded while requests
are in flight, so the stop takes --exit-timeout-secs (default here 5; Triton's own is
30) and then Triton exits at once: the number to read is that it ends under 10 s.

Prints one table; `run_kill_cycles` is what tests/integration/test_kill_cycles.py runs short.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.client.client import LLMClient
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.soak import abort_lines, idle_state  # noqa: E402

ENGINE = {"dtype": "float32", "max_num_seqs": "32", "max_queue_size": "64", "max_model_len": "1024",
          "kv_cache_bytes": str(256 * 1024**2)}
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}
READY_LINE = "holding"


# --------------------------------------------------------------------------- the child


def hold_streams(transport: str, url: str, streams: int) -> None:
    """Open `streams` long streams, say READY_LINE once each had a response, then wait to be killed."""
    first = [threading.Event() for _ in range(streams)]
    ended = [threading.Event() for _ in range(streams)]
    keep: list = []
    if transport == "grpc":
        import tritonclient.grpc as grpcclient

        from pagedserve.client.client import build_inputs

        def on_response(i: int, result, error) -> None:
            first[i].set()
            final = result is not None and result.get_response().parameters["triton_final_response"].bool_param
            if error is not None or final:
                ended[i].set()

        for i in range(streams):
            client = grpcclient.InferenceServerClient(url)
            client.start_stream(callback=lambda result, error, i=i: on_response(i, result, error))
            inputs = build_inputs(grpcclient, f"Tell me a long story about the number {i}:", stream=True, **LONG)
            client.async_stream_infer("llm", inputs, request_id=f"held-{i}")
            keep.append(client)
    else:
        def read(i: int) -> None:
            body = {"text_input": f"Tell me a long story about the number {i}:", "stream": True,
                    "exclude_input_in_output": True, "sampling_parameters": json.dumps(LONG)}
            request = urllib.request.Request(f"http://{url}/v2/models/llm/generate_stream", data=json.dumps(body).encode())
            with urllib.request.urlopen(request, timeout=600) as response:
                for line in response:
                    if line.startswith(b"data:"):
                        first[i].set()

        for i in range(streams):
            threading.Thread(target=read, args=(i,), daemon=True).start()
    for event in first:
        event.wait(120)
    print(f"{READY_LINE} {sum(e.is_set() for e in first)}", flush=True)
    while True:  # like any client, close a gRPC stream once its request has ended (an open
        time.sleep(0.05)  # stream keeps its model loaded on Triton 2.51: see README)
        for i, client in enumerate(keep):
            if ended[i].is_set() and client is not None:
                client.stop_stream()
                keep[i] = None


def start_holder(transport: str, url: str, streams: int, timeout: float = 180.0) -> tuple[subprocess.Popen, int]:
    """The child process and how many of its streams had a response before it said so."""
    child = subprocess.Popen([sys.executable, __file__, "--hold", transport, "--url", url, "--streams", str(streams)],
                             stdout=subprocess.PIPE, text=True)
    line = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not line.startswith(READY_LINE):
        line = child.stdout.readline()
        if not line and child.poll() is not None:
            raise RuntimeError(f"the stream holder exited with {child.returncode}")
    if not line.startswith(READY_LINE):
        child.kill()
        raise RuntimeError("the stream holder never had its streams answered")
    return child, int(line.split()[1])


# --------------------------------------------------------------------------- the parent


@dataclass
class Cycle:
    transport: str
    answered: int
    idle_s: float
    kv_blocks_after: float | None
    server_running: bool
    ready: bool
    answers: bool


@dataclass
class KillReport:
    cycles: list[Cycle] = field(default_factory=list)
    stop_s: float | None = None
    stop_answered: int = 0
    exit_timeout_s: int = 0
    exit_timeout_expired: bool = False
    stub_aborts: list[str] = field(default_factory=list)
    """Crash lines in the server log before the stop."""
    exit_crash_lines: list[str] = field(default_factory=list)
    """Crash lines after it (Triton 2.51 exiting at its exit timeout)."""

    @property
    def healthy(self) -> bool:
        return (all(c.server_running and c.ready and c.answers and c.kv_blocks_after == 0 for c in self.cycles)
                and not self.stub_aborts)


def kill_cycle(server: TritonServer, transport: str, streams: int) -> Cycle:
    url = server.grpc_url if transport == "grpc" else server.http_url
    child, answered = start_holder(transport, url, streams)
    killed = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    state = idle_state(server.metrics_url, timeout=60)
    idle_s = time.monotonic() - killed
    running = server.is_running()
    ready = running and server.is_ready()
    answers = False
    if ready:
        try:
            answers = bool(LLMClient(server.grpc_url).generate("Hi", max_tokens=2, temperature=0))
        except Exception:
            answers = False
    return Cycle(transport, answered, idle_s, state.get("pagedserve:kv_blocks_used"), running, ready, answers)


def stop_with_streams_in_flight(server: TritonServer, streams: int, report: KillReport) -> None:
    child, report.stop_answered = start_holder("grpc", server.grpc_url, streams)
    try:
        started = time.monotonic()
        server.stop()
        report.stop_s = time.monotonic() - started
    finally:
        child.kill()
        child.wait()


def run_kill_cycles(workdir: Path, cycles: int, streams: int, transports: tuple[str, ...] = ("grpc", "http"),
                    exit_timeout_s: int = 5, progress: bool = True) -> KillReport:
    """A server of its own: `cycles` kill cycles per transport, then a stop with `streams` in flight.

    Triton 2.51 tells a python model nothing when it stops: requests in flight keep
    their models loaded until they end or `exit_timeout_s` (--exit-timeout-secs) passes."""
    repository = write_repository(workdir / "model_repository", engine=ENGINE)
    log_file = workdir / "tritonserver.log"
    server = TritonServer(repository, log_file=log_file, workdir=workdir / "triton", exit_timeout_s=exit_timeout_s,
                          models=["llm"])
    report = KillReport()
    server.start(timeout=600)
    try:
        for transport in transports:
            for i in range(cycles):
                cycle = kill_cycle(server, transport, streams)
                report.cycles.append(cycle)
                if progress:
                    print(f"  {transport} cycle {i + 1}/{cycles}: {cycle}", flush=True)
                if not cycle.server_running:
                    break
        report.stub_aborts = abort_lines(str(log_file))
        if server.is_running():
            stop_with_streams_in_flight(server, streams, report)
    finally:
        server.stop()
    log = log_file.read_text(errors="replace") if log_file.exists() else ""
    report.exit_timeout_expired = "Exit timeout expired" in log
    report.exit_timeout_s = exit_timeout_s
    report.exit_crash_lines = abort_lines(str(log_file))[len(report.stub_aborts):]
    return report


def format_report(report: KillReport, streams: int) -> str:
    lines = [f"{'transport':<10}{'cycles':>7}{'answered':>10}{'idle s max':>12}{'KV after':>10}"
             f"{'server up':>11}{'ready':>7}{'answers':>9}"]
    for transport in sorted({c.transport for c in report.cycles}):
        mine = [c for c in report.cycles if c.transport == transport]
        lines.append(
            f"{transport:<10}{len(mine):>7}{min(c.answered for c in mine):>7}/{streams:<2}"
            f"{max(c.idle_s for c in mine):>12.2f}{max(c.kv_blocks_after or 0 for c in mine):>10.0f}"
            f"{sum(c.server_running for c in mine):>8}/{len(mine):<2}{sum(c.ready for c in mine):>4}/{len(mine):<2}"
            f"{sum(c.answers for c in mine):>6}/{len(mine):<2}")
    stop = "not reached" if report.stop_s is None else f"{report.stop_s:.1f} s"
    lines.append(f"stop with {report.stop_answered} streams in flight: {stop} (--exit-timeout-secs="
                 f"{report.exit_timeout_s}; expired: {report.exit_timeout_expired}; crash lines while exiting: "
                 f"{len(report.exit_crash_lines)}); crash lines before the stop: {len(report.stub_aborts)}")
    lines.append("verdict: " + ("healthy" if report.healthy else "NOT healthy"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--transports", default="grpc,http")
    parser.add_argument("--exit-timeout-secs", type=int, default=5)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--hold", choices=["grpc", "http"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hold:
        hold_streams(args.hold, args.url, args.streams)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedserve-kill-"))
    transports = tuple(t for t in args.transports.split(",") if t)
    print(f"kill cycles: {args.cycles} per transport ({', '.join(transports)}), {args.streams} streams; workdir {workdir}")
    report = run_kill_cycles(workdir, args.cycles, args.streams, transports, args.exit_timeout_secs)
    print(format_report(report, args.streams))
    return 0 if report.healthy and report.stop_s is not None and report.stop_s < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
