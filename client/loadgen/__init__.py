"""Load generator for a running server: the `llm` model over gRPC streaming or over
HTTP `generate_stream` (server-sent events), closed or open loop, with TTFT, ITL, TPOT,
E2E percentiles and throughput.

Why our own: serving numbers only mean something when TTFT, inter-token latency and
throughput come from the same client, the same seeded workload and the same
definitions for every system compared (pagedserve in-flight, static batching, a naive
transformers server).

One module per idea:

* :mod:`.config`: :class:`BenchConfig`, everything a run depends on;
* :mod:`.workloads`: what to send (seeded synthetic prompts or a JSONL file);
* :mod:`.transports`: how to send it (gRPC or HTTP/SSE streaming);
* :mod:`.stats`: the metric definitions, as pure functions over request records;
* :mod:`.runner`: the closed and open loops that time every request;
* :mod:`.report`: the plain-text table.
"""

from __future__ import annotations

from .config import BenchConfig
from .report import format_summary
from .runner import BenchResult, measured_requests, run_benchmark, run_benchmark_async, send_one
from .stats import Distribution, RequestRecord, Summary, itl_samples, percentile, poisson_arrivals, summarize, tpot
from .transports import GrpcTransport, HttpTransport, OpenAITransport, ServerError, StreamChunk, Transport, make_transport
from .workloads import JsonlWorkload, RequestSpec, SyntheticWorkload, Workload, load_workload

__all__ = [
    "BenchConfig",
    "BenchResult",
    "Distribution",
    "GrpcTransport",
    "HttpTransport",
    "OpenAITransport",
    "JsonlWorkload",
    "RequestRecord",
    "RequestSpec",
    "ServerError",
    "StreamChunk",
    "Summary",
    "SyntheticWorkload",
    "Transport",
    "Workload",
    "format_summary",
    "itl_samples",
    "load_workload",
    "make_transport",
    "measured_requests",
    "percentile",
    "poisson_arrivals",
    "run_benchmark",
    "run_benchmark_async",
    "send_one",
    "summarize",
    "tpot",
]
