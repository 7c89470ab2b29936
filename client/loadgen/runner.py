"""The run itself: send the workload through a transport and time every response.

Why asyncio: the open loop puts no cap on requests in flight, and one event loop keeps
many streams open without a thread each.

Modes: a fixed number of requests or a duration (no new requests after it; those in
flight finish and count); closed loop (N workers, each sends its next request when the
previous one ends) or open loop (Poisson arrivals at a request rate, seeded, no cap on
requests in flight). Warm-up requests go first and are not recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .config import BenchConfig
from .stats import RequestRecord, Summary, poisson_arrivals, summarize
from .transports import Transport, make_transport
from .workloads import RequestSpec, Workload, load_workload


@dataclass
class BenchResult:
    config: BenchConfig
    summary: Summary
    records: list[RequestRecord]

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "summary": asdict(self.summary), "requests": [asdict(r) for r in self.records]}

    def write_json(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def measured_requests(config: BenchConfig, workload: Workload) -> list[RequestSpec]:
    """The requests a run of `config.num_requests` sends and measures (warm-up aside),
    by index: the same whichever system serves them, so an in-process reference (the
    offline engine in benchmarks/serving.py) can run exactly these."""
    if config.duration is not None or config.num_requests is None:
        raise ValueError("a run for a duration sends as many requests as fit in it: there is no fixed list")
    return [workload.request(index) for index in range(config.num_requests)]


async def send_one(transport: Transport, spec: RequestSpec, sampling: dict[str, Any], t0: float,
                   scheduled: float | None = None) -> RequestRecord:
    """Send one request and time every token-bearing response (never raises)."""
    sent = time.perf_counter()
    record = RequestRecord(
        index=spec.index,
        scheduled=sent - t0 if scheduled is None else scheduled,
        start=sent - t0,
        prompt_tokens=spec.prompt_tokens,
        requested_output_tokens=spec.max_tokens,
    )
    last = None
    received = sent
    try:
        async for chunk in transport.stream(spec, sampling | {"max_tokens": spec.max_tokens}):
            now = received = time.perf_counter()
            if chunk.prompt_tokens is not None:
                record.prompt_tokens = chunk.prompt_tokens
            if chunk.num_tokens <= 0:
                continue
            if last is None:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            record.chunk_tokens.append(chunk.num_tokens)
            record.output_tokens += chunk.num_tokens
            last = now
        record.e2e = received - sent  # the last response, not the stream's close after it
        record.end = received - t0
        if record.output_tokens == 0:
            record.error = "no output tokens"
    except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
        record.end = time.perf_counter() - t0
        record.e2e = None
        record.error = f"{type(exc).__name__}: {exc}".strip()
    return record


async def _closed_loop(transport: Transport, workload: Workload, sampling: dict[str, Any], concurrency: int,
                       num_requests: int | None, duration: float | None, first_index: int,
                       done: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    indices = itertools.count(first_index)
    t0 = time.perf_counter()

    async def worker() -> None:
        while True:
            if duration is not None and time.perf_counter() - t0 >= duration:
                return
            index = next(indices)
            if duration is None and num_requests is not None and index - first_index >= num_requests:
                return
            record = await send_one(transport, workload.request(index), sampling, t0)
            records.append(record)
            done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


async def _open_loop(transport: Transport, workload: Workload, sampling: dict[str, Any], rate: float, seed: int,
                     num_requests: int | None, duration: float | None,
                     done: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    arrivals = poisson_arrivals(rate, seed, count=None if duration is not None else num_requests, duration=duration)

    async def timed(index: int, at: float) -> RequestRecord:
        record = await send_one(transport, workload.request(index), sampling, t0, scheduled=at)
        done(record)
        return record

    tasks = []
    t0 = time.perf_counter()
    for index, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(index, at)))
    return list(await asyncio.gather(*tasks))


async def run_benchmark_async(config: BenchConfig, workload: Workload | None = None, progress: bool = True,
                              on_measured_start: Callable[[], None] | None = None) -> BenchResult:
    """Warm up (not recorded), then the measured run, which `on_measured_start` is told of
    (benchmarks/serving.py starts its CPU readings there); see the module docstring."""
    config.validate()
    workload = workload or load_workload(config)
    sampling: dict[str, Any] = {"temperature": config.temperature}
    if config.ignore_eos:
        sampling["ignore_eos"] = True
    transport = make_transport(config)
    try:
        if config.warmup:
            # Indices far from the measured ones: other prompts, same shape.
            await _closed_loop(transport, workload, sampling, max(1, min(config.concurrency, config.warmup)),
                               config.warmup, None, 10**9, lambda r: None)
        from tqdm.auto import tqdm

        total = None if config.duration is not None else config.num_requests
        bar = tqdm(total=total, desc=config.mode, unit="req", disable=not progress, leave=False)
        errors = 0

        def done(record: RequestRecord) -> None:
            nonlocal errors
            errors += not record.ok
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors)

        if on_measured_start is not None:
            on_measured_start()
        cpu_started = time.process_time()
        try:
            if config.request_rate:
                records = await _open_loop(transport, workload, sampling, config.request_rate, config.seed,
                                           config.num_requests, config.duration, done)
            else:
                records = await _closed_loop(transport, workload, sampling, config.concurrency,
                                             config.num_requests, config.duration, 0, done)
        finally:
            bar.close()
        client_cpu = time.process_time() - cpu_started
    finally:
        await transport.close()
    return BenchResult(config, dataclasses.replace(summarize(records), client_cpu_s=client_cpu), records)


def run_benchmark(config: BenchConfig, workload: Workload | None = None, progress: bool = True) -> BenchResult:
    """Blocking wrapper around :func:`run_benchmark_async` (its own event loop)."""
    return asyncio.run(run_benchmark_async(config, workload, progress))
