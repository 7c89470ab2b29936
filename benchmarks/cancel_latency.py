"""How soon `llm` notices a client's cancellation at a full queue: 64 requests running and the
waiting queue full (1,024), then a few probe requests, running and waiting, are cancelled by
their clients; the time from the cancel to the server log's "aborted request <id> in the engine"
line is the latency (the engine frees its blocks within a step of that).

    python benchmarks/cancel_latency.py                  # starts its own tritonserver
    python benchmarks/cancel_latency.py --running 64 --waiting 1024 --probes 4

Triton's python backend tells a model nothing when a client cancels: each decoupled model asks
`is_cancelled()` of its requests in turn (backend/triton_adapter/cancellation.py), so the
latency grows with the requests in flight; the goal is under 1 s for a generating request.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.soak import read_metrics  # noqa: E402
from pagedserve.client.client import build_inputs  # noqa: E402
from pagedserve.client.repository import write_repository  # noqa: E402
from pagedserve.client.triton_server import TritonServer  # noqa: E402

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
ABORTED = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*aborted request (\S+) in the engine after its client cancelled")


def open_stream(url: str, prompt: str, request_id: str, first: queue.Queue | None = None) -> grpcclient.InferenceServerClient:
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: first.put(request_id) if first is not None else None)
    client.async_stream_infer("llm", build_inputs(grpcclient, prompt, stream=True, **LONG), request_id=request_id)
    return client


def gauges(server: TritonServer) -> tuple[float, float]:
    values = read_metrics(server.metrics_url, ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting"))
    return values["pagedserve:num_requests_running"] or 0.0, values["pagedserve:num_requests_waiting"] or 0.0


def aborted_at(log: Path) -> dict[str, float]:
    """Request id -> when the server logged its abort (epoch seconds; the log's local time, this year)."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        match = ABORTED.match(line)
        if match:
            stamp = datetime.strptime(f"{datetime.now().year}{match.group(1)} {match.group(2)}", "%Y%m%d %H:%M:%S.%f")
            found[match.group(3)] = stamp.timestamp()
    return found


def run(running: int, waiting: int, probes: int, workdir: Path) -> list[tuple[str, float | None]]:
    engine = {"dtype": "float32", "max_num_seqs": str(running), "max_queue_size": str(waiting), "max_model_len": "1024",
              "kv_cache_bytes": str(1024**3)}
    log = workdir / "tritonserver.log"
    server = TritonServer(write_repository(workdir / "model_repository", engine=engine), log_file=log).start(timeout=300)
    try:
        first: queue.Queue = queue.Queue()
        held = [open_stream(server.grpc_url, f"Running probe {i}:", f"running-probe-{i}", first) for i in range(probes)]
        for _ in range(probes):
            first.get(timeout=120)  # each generating
        fillers = grpcclient.InferenceServerClient(server.grpc_url)
        fillers.start_stream(callback=lambda result, error: None)
        for i in range(running - probes + waiting - probes):
            fillers.async_stream_infer("llm", build_inputs(grpcclient, f"Filler {i}:", stream=True, **LONG),
                                       request_id=f"filler-{i}")
        held += [open_stream(server.grpc_url, f"Waiting probe {i}:", f"waiting-probe-{i}") for i in range(probes)]
        deadline = time.monotonic() + 300
        while gauges(server) != (float(running), float(waiting)) and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"in flight: running {gauges(server)[0]:.0f}, waiting {gauges(server)[1]:.0f}", file=sys.stderr)
        time.sleep(5.0)  # past the first asks, which every new request gets at once
        cancelled = {}
        for client, request_id in zip(held, [f"running-probe-{i}" for i in range(probes)] +
                                      [f"waiting-probe-{i}" for i in range(probes)]):
            cancelled[request_id] = time.time()
            client.stop_stream(cancel_requests=True)
            client.close()
            time.sleep(1.73)  # cancels at different phases of the watchers' rotation
        time.sleep(20)
        fillers.stop_stream(cancel_requests=True)
        fillers.close()
        seen = aborted_at(log)
        return [(request_id, seen[request_id] - at if request_id in seen else None) for request_id, at in cancelled.items()]
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--waiting", type=int, default=1024)
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    latencies = run(args.running, args.waiting, args.probes, Path(tempfile.mkdtemp(prefix="pagedserve-cancel-")))
    print(f"| probe | at a full queue ({args.running} running, {args.waiting} waiting) | noticed after (s) |")
    print("|---|---|---:|")
    for request_id, latency in latencies:
        print(f"| {request_id} | {'generating' if request_id.startswith('running') else 'waiting'} | "
              f"{'never (within 20 s)' if latency is None else f'{latency:.2f}'} |")
    for kind in ("running", "waiting"):
        values = [v for r, v in latencies if r.startswith(kind) and v is not None]
        if values:
            print(f"{kind}: median {statistics.median(values):.2f} s, max {max(values):.2f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(latencies) + "\n")
    return 0 if all(v is not None for _, v in latencies) else 1


if __name__ == "__main__":
    raise SystemExit(main())
