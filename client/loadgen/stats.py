"""What a request measured and the statistics of a run, as pure functions so the
definitions can be tested on a synthetic trace and are the same for every system:

* TTFT: request sent -> first response carrying at least one output token.
* ITL: the gap before each later token-bearing response, split evenly over the tokens
  that response carries (one sample per token; with one token per response, as both
  servers send, it is exactly the gap between responses).
* TPOT, per request: (E2E - TTFT) / (output tokens - 1); requests with one token have none.
* E2E: request sent -> last response received.
* Throughput: output tokens (and requests) of successful requests divided by the
  measured window, first request sent -> last request finished (warm-up excluded).
  Failed requests count as errors, not in latencies or throughput.

The open loop's Poisson schedule is here too: it is seeded arithmetic, like the rest.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `scheduled`, `start` and `end`
    count from the start of the measured run."""

    index: int
    scheduled: float  # open loop: the Poisson arrival time; closed loop: = start
    start: float  # request sent
    end: float | None = None  # final response, or the error
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gap before each later token-bearing response
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per token-bearing response, first included
    e2e: float | None = None  # None for a failed request
    prompt_tokens: int | None = None
    output_tokens: int = 0
    requested_output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds (None when there are no samples)."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(count=0)
        ordered = sorted(values)
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            min=ordered[0],
            max=ordered[-1],
        )


@dataclass(frozen=True)
class Summary:
    """Statistics of one run over its measured window."""

    num_requests: int
    num_ok: int
    num_errors: int
    window_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    error_examples: list[str] = field(default_factory=list)
    num_responses: int = 0
    """Token-bearing streamed responses of the successful requests."""
    client_cpu_s: float | None = None
    """CPU the load generator's process spent over the run (all its threads): on a machine
    it shares with the server, a client's cost per response is taken from the server."""

    @property
    def client_cpu_per_response_us(self) -> float | None:
        if self.client_cpu_s is None or not self.num_responses:
            return None
        return 1e6 * self.client_cpu_s / self.num_responses


def percentile(ordered: Sequence[float], q: float) -> float:
    """q-th percentile of already sorted values, linear interpolation between closest
    ranks (numpy's default), so p50 of [1, 2, 3, 4] is 2.5."""
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def itl_samples(record: RequestRecord) -> list[float]:
    """Per-token inter-token latencies: each later response's gap split over its tokens."""
    samples: list[float] = []
    for gap, tokens in zip(record.itl, record.chunk_tokens[1:]):
        if tokens > 0:
            samples.extend([gap / tokens] * tokens)
    return samples


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1)."""
    if not record.ok or record.ttft is None or record.e2e is None or record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def summarize(records: Sequence[RequestRecord]) -> Summary:
    """Summary of a run. The window runs from the first request sent to the last one
    finished (failed ones included: they occupied it too)."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    ends = [r.end for r in records if r.end is not None]
    window = (max(ends) - min(r.start for r in records)) if records and ends else 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    examples = list(dict.fromkeys(r.error for r in errors if r.error))[:5]
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(errors),
        window_s=window,
        requests_per_s=len(ok) / window if window > 0 else 0.0,
        output_tokens_per_s=output_tokens / window if window > 0 else 0.0,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_output_tokens=output_tokens,
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        itl=Distribution.of([s for r in ok for s in itl_samples(r)]),
        tpot=Distribution.of([t for t in map(tpot, ok) if t is not None]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        error_examples=examples,
        num_responses=sum(len(r.chunk_tokens) for r in ok),
    )


def poisson_arrivals(rate: float, seed: int, count: int | None = None, duration: float | None = None) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process: exponential gaps with mean
    1/rate. Stops after `count` arrivals or before `duration`, whichever comes first."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if count is None and duration is None:
        raise ValueError("give count or duration")
    rng = random.Random(f"arrivals:{seed}")
    times: list[float] = []
    now = 0.0
    while count is None or len(times) < count:
        now += rng.expovariate(rate)
        if duration is not None and now >= duration:
            break
        times.append(now)
    return times
