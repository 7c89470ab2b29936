"""`pagedserve bench`: load-generate against a running server and print TTFT, ITL,
TPOT, E2E percentiles and throughput (see client/loadgen/stats.py for the definitions).

Only argparse is imported here: `pagedserve --help` builds this parser every time, so
the load generator (tritonclient, aiohttp, the tokenizer) loads when the command runs.
"""

from __future__ import annotations

import argparse

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000", "openai": "localhost:9000"}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedserve bench`; sets `run`."""
    target = parser.add_argument_group("target")
    target.add_argument("--url", default=None,
                        help="server address (default: localhost:8001 grpc, localhost:8000 http, localhost:9000 openai)")
    target.add_argument("--protocol", choices=("grpc", "http", "openai"), default="grpc",
                        help="grpc: tritonclient streaming; http: POST /v2/models/<model>/generate_stream (SSE); "
                             "openai: POST /v1/completions (SSE), e.g. `pagedserve openai` or vLLM's server")
    target.add_argument("--model-name", default="llm")

    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=64, help="measured requests (default 64)")
    load.add_argument("--duration", type=float, default=None,
                      help="send for this many seconds instead of a request count (requests in flight then finish)")
    load.add_argument("--concurrency", type=int, default=1, help="closed loop: requests in flight (default 1)")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: Poisson arrivals at this many requests/s (overrides --concurrency)")
    load.add_argument("--warmup", type=int, default=2, help="unrecorded requests sent first (default 2)")
    load.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")

    work = parser.add_argument_group("workload")
    work.add_argument("--prompt-len-mean", type=int, default=128, help="synthetic prompt tokens, mean (default 128)")
    work.add_argument("--prompt-len-range", type=int, default=64, help="prompt tokens uniform in mean ± range (default 64)")
    work.add_argument("--output-len", type=int, default=64, help="output tokens, forced with ignore_eos (default 64)")
    work.add_argument("--output-len-range", type=int, default=0, help="output tokens uniform in len ± range (default 0)")
    work.add_argument("--prompts-jsonl", default=None, help='prompts file, one {"prompt": ..., "max_tokens": N} per line')
    work.add_argument("--tokenizer", default="",
                      help="tokenizer for exact prompt lengths (default: the bundled model's; 'none': approximate)")
    work.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    work.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at end-of-sequence")

    parser.add_argument("--json-out", default=None, help="write the config, summary and every request's record here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_bench)


def config_from_args(args: argparse.Namespace):
    """The BenchConfig the flags describe."""
    from .loadgen import BenchConfig

    return BenchConfig(
        url=args.url or DEFAULT_URLS[args.protocol],
        protocol=args.protocol,
        model_name=args.model_name,
        num_requests=args.num_requests,
        duration=args.duration,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        prompt_len_mean=args.prompt_len_mean,
        prompt_len_range=args.prompt_len_range,
        output_len=args.output_len,
        output_len_range=args.output_len_range,
        prompts_jsonl=args.prompts_jsonl,
        tokenizer=None if args.tokenizer.lower() == "none" else args.tokenizer,
        seed=args.seed,
        warmup=args.warmup,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
    )


def run_bench(args: argparse.Namespace) -> int:
    import sys

    from .loadgen import format_summary, run_benchmark

    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        print(f"pagedserve bench: {exc}", file=sys.stderr)
        return 2
    print(f"{config.protocol} {config.url} model {config.model_name}: {config.mode}", flush=True)
    result = run_benchmark(config, progress=not args.no_progress)
    print(format_summary(result.summary))
    if args.json_out:
        result.write_json(args.json_out)
        print(f"records: {args.json_out}")
    return 1 if result.summary.num_errors else 0
