"""Load generator for a running server: the `llm` model over gRPC streaming
(tritonclient.grpc.aio, one stream per request) or over HTTP `generate_stream`
(server-sent events, aiohttp).

Why our own: serving numbers only mean something when TTFT, inter-token latency and
throughput come from the same client, the same seeded workload and the same
definitions for every system compared (pagedserve in-flight, static batching, a naive
transformers server). The definitions live in pure functions below so they can be
tested on a synthetic trace:

* TTFT: request sent -> first response carrying at least one output token.
* ITL: the gap before each later token-bearing response, split evenly over the tokens
  that response carries (one sample per token; with one token per response, as both
  servers send, it is exactly the gap between responses).
* TPOT, per request: (E2E - TTFT) / (output tokens - 1); requests with one token have none.
* E2E: request sent -> last response received.
* Throughput: output tokens (and requests) of successful requests divided by the
  measured window, first request sent -> last request finished (warm-up excluded).
  Failed requests count as errors, not in latencies or throughput.

Modes: a fixed number of requests or a duration (no new requests after it; those in
flight finish and count); closed loop (N workers, each sends its next request when the
previous one ends) or open loop (Poisson arrivals at a request rate, seeded, no cap on
requests in flight).

Prompts: synthetic, or one per line of a JSONL file (`{"prompt": ..., "max_tokens": ...}`).
Synthetic prompts are random words from a fixed list. With a tokenizer (default: the
bundled model's) the list is cut to words that are exactly one token both at the start
and after a space, so a prompt of n words is n tokens; each prompt is checked with the
tokenizer and its real count recorded. Without one (`tokenizer=None`), n words is only
approximately n tokens. Output lengths are forced with `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

__all__ = [
    "BenchConfig",
    "BenchResult",
    "Distribution",
    "JsonlWorkload",
    "RequestRecord",
    "RequestSpec",
    "Summary",
    "SyntheticWorkload",
    "format_summary",
    "itl_samples",
    "percentile",
    "poisson_arrivals",
    "run_benchmark",
    "summarize",
    "tpot",
]

# Common English words; with a tokenizer, those that are not one token are dropped.
VOCABULARY = (
    "the of and to in is was for on are with as be at by this had not but from or have an they which one "
    "you were all her she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three place small found part house home "
    "water light river city country field music story paper money table window garden school market road "
    "train green blue red white black open close early late quick slow warm cold happy quiet simple strong "
    "bright clear dark deep soft hard short tall wide young ready free full sure true whole real best better "
    "number point group problem fact hand eye head face name word family friend night morning evening week "
    "month game line side end form order power course level rest kind sort change interest reason study plan"
).split()


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: prompt text, forced output length, and the prompt's token
    count when the client knows it (synthetic prompts with a tokenizer)."""

    index: int
    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None


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


# --------------------------------------------------------------------------- statistics (pure)


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


# --------------------------------------------------------------------------- workloads


class Workload(Protocol):
    def request(self, index: int) -> RequestSpec: ...


def _uniform(rng: random.Random, mean: int, spread: int) -> int:
    return max(1, rng.randint(mean - spread, mean + spread))


def single_token_words(tokenizer: Any, words: Sequence[str] = VOCABULARY) -> list[str]:
    """Words the tokenizer encodes as one token both alone and after a space."""
    keep = []
    for word in words:
        alone = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(alone) == 1 and len(spaced) == 1:
            keep.append(word)
    if len(keep) < 20:
        raise ValueError("the tokenizer keeps fewer than 20 single-token words; pass tokenizer=None")
    return keep


def count_tokens(tokenizer: Any, text: str) -> int:
    """Prompt tokens as the server counts them (pagedserve encodes with the defaults)."""
    return len(tokenizer.encode(text))


@dataclass
class SyntheticWorkload:
    """Random-word prompts of uniform length in mean ± range, outputs in len ± range.

    Request i depends only on (seed, i), so every system and every concurrency level
    sees the same prompts in the same order.
    """

    prompt_len_mean: int = 128
    prompt_len_range: int = 64
    output_len: int = 64
    output_len_range: int = 0
    seed: int = 0
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self._words = single_token_words(self.tokenizer) if self.tokenizer is not None else list(VOCABULARY)

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(f"prompt:{self.seed}:{index}")
        target = _uniform(rng, self.prompt_len_mean, self.prompt_len_range)
        prompt = " ".join(rng.choice(self._words) for _ in range(target))
        tokens = count_tokens(self.tokenizer, prompt) if self.tokenizer is not None else None
        return RequestSpec(index, prompt, _uniform(rng, self.output_len, self.output_len_range), tokens)


@dataclass
class JsonlWorkload:
    """Prompts from a JSONL file, `{"prompt": "...", "max_tokens": N}` per line (max_tokens
    optional; otherwise output_len ± output_len_range). Requests cycle through the file."""

    path: str | Path
    output_len: int = 64
    output_len_range: int = 0
    seed: int = 0
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self._lines: list[tuple[str, int | None]] = []
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    prompt = item["prompt"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.path}:{number}: expected {{\"prompt\": ...}}: {exc}") from None
                if not isinstance(prompt, str):
                    raise ValueError(f"{self.path}:{number}: 'prompt' must be a string")
                max_tokens = item.get("max_tokens")
                self._lines.append((prompt, int(max_tokens) if max_tokens is not None else None))
        if not self._lines:
            raise ValueError(f"{self.path}: no prompts")

    def request(self, index: int) -> RequestSpec:
        prompt, max_tokens = self._lines[index % len(self._lines)]
        if max_tokens is None:
            max_tokens = _uniform(random.Random(f"output:{self.seed}:{index}"), self.output_len, self.output_len_range)
        tokens = count_tokens(self.tokenizer, prompt) if self.tokenizer is not None else None
        return RequestSpec(index, prompt, max_tokens, tokens)


# --------------------------------------------------------------------------- transports


@dataclass
class StreamChunk:
    """One streamed response as the load generator needs it."""

    num_tokens: int
    prompt_tokens: int | None = None


class ServerError(RuntimeError):
    """The server answered the request with an error."""


class GrpcBackend:
    """`llm` over tritonclient.grpc.aio: one bidirectional stream per request.

    After the final response the stream is drained to its natural end (the request
    iterator has already half-closed it) rather than cancelled: a finished request
    needs no cancellation, and the server should see a plain close."""

    def __init__(self, url: str, model: str, timeout: float | None = None):
        import tritonclient.grpc.aio as aioclient

        self._module = aioclient
        self.client = aioclient.InferenceServerClient(url)
        self.model = model
        self.timeout = timeout

    async def stream(self, spec: RequestSpec, sampling: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        import numpy as np

        from .client import build_inputs, parse_result

        inputs = build_inputs(self._module, spec.prompt, stream=True, **sampling)
        count_input = self._module.InferInput("return_num_input_tokens", [1], "BOOL")
        count_input.set_data_from_numpy(np.array([True]))
        inputs.append(count_input)

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        responses = self.client.stream_infer(requests(), stream_timeout=self.timeout)
        final = False
        try:
            async for result, error in responses:
                if final:
                    continue  # draining: nothing more is expected
                if error is not None:
                    raise ServerError(str(error))
                chunk = parse_result(result)
                num_input = result.as_numpy("num_input_tokens")
                yield StreamChunk(chunk.num_output_tokens, int(num_input.sum()) if num_input is not None and num_input.size else None)
                final = chunk.final
            if not final:
                raise ServerError("the stream ended without a final response")
        except BaseException:
            if not final:
                responses.cancel()  # give up on the request (error, timeout, or the run was stopped)
            raise

    async def close(self) -> None:
        await self.client.close()


class HttpBackend:
    """Triton's `POST /v2/models/<model>/generate_stream` (SSE); the naive baseline
    server speaks the same. Responses without `num_output_tokens` count as one token
    when they carry text."""

    def __init__(self, url: str, model: str, timeout: float | None = None):
        import aiohttp

        base = url if url.startswith(("http://", "https://")) else f"http://{url}"
        self.endpoint = f"{base.rstrip('/')}/v2/models/{model}/generate_stream"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # open loop may have many requests in flight
            timeout=aiohttp.ClientTimeout(total=timeout),
        )

    async def stream(self, spec: RequestSpec, sampling: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        body = {
            "text_input": spec.prompt,
            "stream": True,
            "exclude_input_in_output": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "sampling_parameters": json.dumps(sampling),
        }
        async with self.session.post(self.endpoint, json=body) as response:
            if response.status != 200:
                text = await response.text()
                raise ServerError(f"HTTP {response.status}: {_event_error(text) or text.strip()[:300]}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ServerError(str(event["error"]))
                if "num_output_tokens" in event:
                    tokens = int(event["num_output_tokens"] or 0)
                else:
                    tokens = 1 if event.get("text_output") else 0
                prompt_tokens = event.get("num_input_tokens")
                yield StreamChunk(tokens, int(prompt_tokens) if isinstance(prompt_tokens, (int, float)) else None)

    async def close(self) -> None:
        await self.session.close()


def _event_error(text: str) -> str | None:
    """The error message of an SSE or JSON error body, if it is one."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:]
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            return str(event["error"])
    return None


# --------------------------------------------------------------------------- the run


@dataclass
class BenchConfig:
    """Everything a run depends on; stored with its results."""

    url: str = "localhost:8001"
    protocol: str = "grpc"  # grpc | http
    model_name: str = "llm"
    num_requests: int | None = 64
    duration: float | None = None  # seconds; overrides num_requests
    concurrency: int = 1  # closed loop
    request_rate: float | None = None  # requests/s; open loop when set
    prompt_len_mean: int = 128
    prompt_len_range: int = 64
    output_len: int = 64
    output_len_range: int = 0
    prompts_jsonl: str | None = None
    tokenizer: str | None = ""  # "": the bundled model's; None: none (approximate prompt lengths)
    seed: int = 0
    warmup: int = 2
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout: float | None = 1800.0  # seconds for a whole request (a hung server must not hang the run)

    def validate(self) -> None:
        if self.protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {self.protocol!r}")
        if self.duration is None and (self.num_requests is None or self.num_requests < 1):
            raise ValueError("give num_requests >= 1 or a duration")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if self.request_rate is None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if min(self.prompt_len_mean, self.output_len) < 1 or min(self.prompt_len_range, self.output_len_range, self.warmup) < 0:
            raise ValueError("lengths must be >= 1, ranges and warmup >= 0")

    @property
    def mode(self) -> str:
        return f"open loop, {self.request_rate:g} req/s" if self.request_rate else f"closed loop, concurrency {self.concurrency}"


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


def load_workload(config: BenchConfig) -> Workload:
    tokenizer = None
    if config.tokenizer is not None:
        from pagedserve.backend.loader import default_model_path, load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer or default_model_path())
    if config.prompts_jsonl:
        return JsonlWorkload(config.prompts_jsonl, config.output_len, config.output_len_range, config.seed, tokenizer)
    return SyntheticWorkload(
        config.prompt_len_mean, config.prompt_len_range, config.output_len, config.output_len_range, config.seed, tokenizer
    )


def make_backend(config: BenchConfig) -> GrpcBackend | HttpBackend:
    """Call inside the running event loop (aiohttp binds its session to it)."""
    if config.protocol == "http":
        return HttpBackend(config.url, config.model_name, config.request_timeout)
    return GrpcBackend(config.url, config.model_name)


async def send_one(backend: Any, spec: RequestSpec, sampling: dict[str, Any], t0: float, scheduled: float | None = None) -> RequestRecord:
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
        async for chunk in backend.stream(spec, sampling | {"max_tokens": spec.max_tokens}):
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


async def _closed_loop(backend: Any, workload: Workload, sampling: dict[str, Any], concurrency: int,
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
            record = await send_one(backend, workload.request(index), sampling, t0)
            records.append(record)
            done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


async def _open_loop(backend: Any, workload: Workload, sampling: dict[str, Any], rate: float, seed: int,
                     num_requests: int | None, duration: float | None,
                     done: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    arrivals = poisson_arrivals(rate, seed, count=None if duration is not None else num_requests, duration=duration)

    async def timed(index: int, at: float) -> RequestRecord:
        record = await send_one(backend, workload.request(index), sampling, t0, scheduled=at)
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


async def run_benchmark_async(config: BenchConfig, workload: Workload | None = None, progress: bool = True) -> BenchResult:
    """Warm up (not recorded), then the measured run; see the module docstring."""
    config.validate()
    workload = workload or load_workload(config)
    sampling: dict[str, Any] = {"temperature": config.temperature}
    if config.ignore_eos:
        sampling["ignore_eos"] = True
    backend = make_backend(config)
    try:
        if config.warmup:
            # Indices far from the measured ones: other prompts, same shape.
            await _closed_loop(backend, workload, sampling, max(1, min(config.concurrency, config.warmup)),
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

        try:
            if config.request_rate:
                records = await _open_loop(backend, workload, sampling, config.request_rate, config.seed,
                                           config.num_requests, config.duration, done)
            else:
                records = await _closed_loop(backend, workload, sampling, config.concurrency,
                                             config.num_requests, config.duration, 0, done)
        finally:
            bar.close()
    finally:
        await backend.close()
    return BenchResult(config, summarize(records), records)


def run_benchmark(config: BenchConfig, workload: Workload | None = None, progress: bool = True) -> BenchResult:
    """Blocking wrapper around :func:`run_benchmark_async` (its own event loop)."""
    return asyncio.run(run_benchmark_async(config, workload, progress))


# --------------------------------------------------------------------------- output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_summary(summary: Summary, title: str = "") -> str:
    """A plain-text table of the run (latencies in ms)."""
    lines = [title] if title else []
    lines.append(
        f"requests {summary.num_requests}  ok {summary.num_ok}  errors {summary.num_errors}  "
        f"window {summary.window_s:.1f} s  prompt tokens {summary.total_prompt_tokens}  "
        f"output tokens {summary.total_output_tokens}"
    )
    lines.append(f"throughput  {summary.requests_per_s:.2f} req/s  {summary.output_tokens_per_s:.1f} output tok/s")
    lines.append(f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'samples':>10}")
    for name in ("ttft", "itl", "tpot", "e2e"):
        d: Distribution = getattr(summary, name)
        lines.append(f"{name.upper():<6}{_ms(d.mean):>10}{_ms(d.p50):>10}{_ms(d.p90):>10}{_ms(d.p99):>10}{d.count:>10}")
    for example in summary.error_examples:
        lines.append(f"error: {example}")
    return "\n".join(lines)
