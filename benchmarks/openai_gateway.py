"""What `pagedserve openai` costs: the same seeded workload sent straight to the `llm`
model over gRPC streaming and through the gateway's /v1/completions (SSE), side by side
in one run, at each concurrency; rounds alternate the order (gRPC first, then gateway
first) so that drift on a shared machine falls on both.

    python benchmarks/openai_gateway.py                      # concurrency 1 and 32, ~10 min on 2 cores
    python benchmarks/openai_gateway.py --concurrency 1,8 --rounds 1 --dtype float32

Starts its own tritonserver (project repository, prefix caching off, 32 sequences) and
gateway; prints a markdown table: output tokens/s, TTFT p50, ITL p50 per path, and the
gateway's throughput as a fraction of gRPC's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.backend.device import cpuinfo, native_bf16_flags
from pagedserve.client.loadgen import BenchConfig, Summary, load_workload, run_benchmark_async
from pagedserve.client.process import ServerProcess, free_port, http_status
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

PATHS = {"grpc": "gRPC straight to `llm`", "openai": "through `pagedserve openai`"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,32", help="comma-separated closed-loop concurrencies")
    p.add_argument("--requests-per-slot", type=float, default=3, help="requests per point: max(12, this x concurrency)")
    p.add_argument("--rounds", type=int, default=2, help="repeats of each point, order alternating")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len-mean", type=int, default=128)
    p.add_argument("--prompt-len-range", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-len-range", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    return p.parse_args(argv)


def start(workdir: Path, dtype: str) -> tuple[TritonServer, ServerProcess, int]:
    engine = {"dtype": dtype, "enable_prefix_caching": "false", "max_num_seqs": "32", "max_queue_size": "64"}
    server = TritonServer(write_repository(workdir / "model_repository", engine=engine), log_file=workdir / "tritonserver.log")
    print("starting tritonserver ...", flush=True)
    server.start(timeout=600)
    port = free_port()
    gateway = ServerProcess([sys.executable, "-m", "pagedserve.client.cli", "openai", "--port", str(port),
                             "--triton-url", server.grpc_url], workdir / "gateway.log", name="pagedserve openai").start()
    gateway.wait_ready(lambda: http_status(f"http://localhost:{port}/health") == 200, time.monotonic() + 60)
    return server, gateway, port


async def measure(url: str, protocol: str, concurrency: int, args: argparse.Namespace) -> Summary:
    config = BenchConfig(
        url=url, protocol=protocol, num_requests=max(12, int(args.requests_per_slot * concurrency)),
        concurrency=concurrency, prompt_len_mean=args.prompt_len_mean, prompt_len_range=args.prompt_len_range,
        output_len=args.output_len, output_len_range=args.output_len_range, seed=args.seed, warmup=2,
    )
    result = await run_benchmark_async(config, load_workload(config), progress=True)
    if result.summary.num_errors:
        raise SystemExit(f"{protocol} at concurrency {concurrency}: errors {result.summary.error_examples}")
    return result.summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedserve-gateway-bench-"))
    server, gateway, port = start(workdir, args.dtype)
    urls = {"grpc": server.grpc_url, "openai": f"localhost:{port}"}
    results: dict[tuple[int, str], list[Summary]] = {}
    started = time.time()
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for round_ in range(args.rounds):
                order = ("grpc", "openai") if round_ % 2 == 0 else ("openai", "grpc")
                for protocol in order:
                    summary = asyncio.run(measure(urls[protocol], protocol, concurrency, args))
                    results.setdefault((concurrency, protocol), []).append(summary)
                    print(f"concurrency {concurrency:>3} round {round_ + 1} {protocol:>6}: "
                          f"{summary.output_tokens_per_s:7.1f} tok/s, TTFT p50 {summary.ttft.p50 * 1e3:6.0f} ms", flush=True)
    finally:
        gateway.stop()
        server.stop()
    print()
    print(report(results, args, (time.time() - started) / 60))
    return 0


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def report(results: dict[tuple[int, str], list[Summary]], args: argparse.Namespace, minutes: float) -> str:
    lines = [
        "| concurrency | path | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | gateway / gRPC throughput |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for concurrency in sorted({c for c, _ in results}):
        grpc_tps = mean([s.output_tokens_per_s for s in results[(concurrency, "grpc")]])
        for protocol in ("grpc", "openai"):
            runs = results[(concurrency, protocol)]
            tps = mean([s.output_tokens_per_s for s in runs])
            ratio = f"{tps / grpc_tps:.3f}" if protocol == "openai" else ""
            lines.append(f"| {concurrency} | {PATHS[protocol]} | {tps:.1f} | {mean([s.ttft.p50 for s in runs]) * 1e3:.0f} | "
                         f"{mean([s.itl.p50 for s in runs]) * 1e3:.1f} | {ratio} |")
    bf16 = " ".join(native_bf16_flags(cpuinfo())) or "none"
    lines += [
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (bf16 flags: {bf16}); server, gateway and load generator "
        f"share it. {args.rounds} rounds per point (order alternating), mean shown; {minutes:.0f} min in all. "
        f"Workload: seeded (seed {args.seed}), prompts {args.prompt_len_mean - args.prompt_len_range}-"
        f"{args.prompt_len_mean + args.prompt_len_range} tokens, outputs {args.output_len - args.output_len_range}-"
        f"{args.output_len + args.output_len_range} forced with ignore_eos, greedy, dtype {args.dtype}, prefix caching off.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
