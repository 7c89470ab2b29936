"""Load generator: statistics on a synthetic trace, the Poisson schedule, workloads, and
the request/loop machinery against a fake transport (no server)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import numpy as np
import pytest

from pagedserve.client import loadgen
from pagedserve.client.loadgen import runner, workloads
from pagedserve.client.loadgen import (
    Distribution,
    JsonlWorkload,
    RequestRecord,
    RequestSpec,
    StreamChunk,
    SyntheticWorkload,
    itl_samples,
    percentile,
    poisson_arrivals,
    summarize,
    tpot,
)


# --------------------------------------------------------------------------- percentiles


def test_percentile_interpolates_linearly_between_ranks():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy():
    values = sorted(np.random.default_rng(0).exponential(size=101).tolist())
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_of_nothing_has_no_values():
    assert Distribution.of([]) == Distribution(count=0)
    d = Distribution.of([3.0, 1.0, 2.0])
    assert (d.count, d.mean, d.p50, d.min, d.max) == (3, 2.0, 2.0, 1.0, 3.0)


# --------------------------------------------------------------------------- a synthetic trace


def trace() -> list[RequestRecord]:
    """Four requests: two normal, one with a two-token response, one failed, one single-token."""
    return [
        # 4 tokens, one per response: TTFT 0.1, gaps 0.05 each.
        RequestRecord(index=0, scheduled=0.0, start=0.0, end=0.25, ttft=0.1, itl=[0.05, 0.05, 0.05],
                      chunk_tokens=[1, 1, 1, 1], e2e=0.25, prompt_tokens=10, output_tokens=4, requested_output_tokens=4),
        # 4 tokens; the second response carries two (its 0.1 s gap is 0.05 per token).
        RequestRecord(index=1, scheduled=0.5, start=0.5, end=0.9, ttft=0.2, itl=[0.1, 0.1],
                      chunk_tokens=[1, 2, 1], e2e=0.4, prompt_tokens=20, output_tokens=4, requested_output_tokens=4),
        # Failed after two tokens: counted as an error only, but its end bounds the window.
        RequestRecord(index=2, scheduled=0.6, start=0.6, end=1.0, ttft=0.1, itl=[0.1], chunk_tokens=[1, 1],
                      e2e=None, prompt_tokens=30, output_tokens=2, requested_output_tokens=4, error="ServerError: boom"),
        # One token: a TTFT and an E2E, no ITL, no TPOT.
        RequestRecord(index=3, scheduled=0.2, start=0.2, end=0.5, ttft=0.3, chunk_tokens=[1], e2e=0.3,
                      prompt_tokens=5, output_tokens=1, requested_output_tokens=1),
    ]


def test_ttft_itl_tpot_definitions():
    r0, r1, _, r3 = trace()
    assert itl_samples(r0) == pytest.approx([0.05, 0.05, 0.05])
    assert itl_samples(r1) == pytest.approx([0.05, 0.05, 0.1])  # the two-token response split in two
    assert itl_samples(r3) == []
    assert tpot(r0) == pytest.approx((0.25 - 0.1) / 3)
    assert tpot(r1) == pytest.approx((0.4 - 0.2) / 3)
    assert tpot(r3) is None


def test_tpot_equals_the_mean_itl_when_every_response_has_one_token():
    r0 = trace()[0]
    assert tpot(r0) == pytest.approx(statistics.mean(itl_samples(r0)))


def test_summary_of_the_trace():
    s = summarize(trace())
    assert (s.num_requests, s.num_ok, s.num_errors) == (4, 3, 1)
    assert s.window_s == pytest.approx(1.0)  # first start 0.0, last end 1.0 (the failed request)
    assert s.total_output_tokens == 9  # the failed request's 2 tokens do not count
    assert s.total_prompt_tokens == 35
    assert s.output_tokens_per_s == pytest.approx(9.0)
    assert s.requests_per_s == pytest.approx(3.0)
    assert s.ttft.count == 3 and s.ttft.mean == pytest.approx(0.2) and s.ttft.p50 == pytest.approx(0.2)
    assert s.ttft.p99 == pytest.approx(0.298)
    assert s.itl.count == 6 and s.itl.mean == pytest.approx(0.35 / 6)
    assert s.tpot.count == 2
    assert s.e2e.count == 3 and s.e2e.max == pytest.approx(0.4)
    assert s.error_examples == ["ServerError: boom"]


def test_error_accounting_and_an_all_failed_run():
    failed = [RequestRecord(index=i, scheduled=0.0, start=0.0, end=0.1 * (i + 1), error="ServerError: busy") for i in range(3)]
    s = summarize(failed)
    assert (s.num_ok, s.num_errors) == (0, 3)
    assert s.error_examples == ["ServerError: busy"]  # deduplicated
    assert s.output_tokens_per_s == 0.0 and s.ttft.count == 0 and s.ttft.p50 is None
    assert summarize([]).window_s == 0.0


def test_the_client_cpu_is_given_per_token_bearing_response():
    """On a shared machine the client's CPU per response is taken from the server: say it."""
    import dataclasses

    s = summarize(trace())
    assert s.num_responses == 8  # the successful requests' responses: 4 + 3 + 1
    assert s.client_cpu_per_response_us is None and "client CPU" not in loadgen.format_summary(s)
    measured = dataclasses.replace(s, client_cpu_s=0.002)
    assert measured.client_cpu_per_response_us == pytest.approx(250.0)
    assert "client CPU  0.00 s: 250 us per streamed response (0.2% of a core" in loadgen.format_summary(measured)


def test_summary_and_records_serialize_to_json():
    from dataclasses import asdict

    json.dumps(asdict(summarize(trace())))
    assert "TTFT" in loadgen.format_summary(summarize(trace()))


# --------------------------------------------------------------------------- Poisson arrivals


def test_poisson_arrivals_are_seeded():
    assert poisson_arrivals(2.0, seed=1, count=50) == poisson_arrivals(2.0, seed=1, count=50)
    assert poisson_arrivals(2.0, seed=1, count=50) != poisson_arrivals(2.0, seed=2, count=50)


def test_poisson_arrivals_have_the_requested_mean_rate():
    rate = 5.0
    times = poisson_arrivals(rate, seed=0, count=20000)
    assert len(times) == 20000 and times == sorted(times) and times[0] > 0
    assert len(times) / times[-1] == pytest.approx(rate, rel=0.03)
    gaps = np.diff([0.0, *times])
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1


def test_poisson_arrivals_for_a_duration():
    times = poisson_arrivals(10.0, seed=3, duration=100.0)
    assert all(t < 100.0 for t in times)
    assert len(times) == pytest.approx(1000, rel=0.1)
    assert len(poisson_arrivals(10.0, seed=3, count=5, duration=100.0)) == 5
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, seed=0, count=1)


# --------------------------------------------------------------------------- workloads


class WordTokenizer:
    """One token per space-separated word, except words containing 'x', which are two."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0 for word in text.split() for _ in range(2 if "x" in word else 1)]


def test_synthetic_workload_is_seeded_per_request_and_within_ranges():
    w = SyntheticWorkload(prompt_len_mean=20, prompt_len_range=5, output_len=10, output_len_range=3, seed=7)
    specs = [w.request(i) for i in range(200)]
    assert [w.request(i) for i in (5, 3)] == [specs[5], specs[3]]  # order does not matter
    assert all(15 <= len(s.prompt.split()) <= 25 and 7 <= s.max_tokens <= 13 for s in specs)
    assert {len(s.prompt.split()) for s in specs} == set(range(15, 26))
    assert all(s.prompt_tokens is None for s in specs)  # no tokenizer: lengths are approximate
    assert SyntheticWorkload(20, 5, 10, 3, seed=8).request(0) != specs[0]


def test_synthetic_workload_with_a_tokenizer_hits_the_token_count_exactly():
    loadgen_vocab = list(workloads.VOCABULARY) + ["xylophone", "box"]
    words = workloads.single_token_words(WordTokenizer(), loadgen_vocab)
    assert "box" not in words and "xylophone" not in words
    w = SyntheticWorkload(prompt_len_mean=30, prompt_len_range=10, output_len=4, seed=0, tokenizer=WordTokenizer())
    for i in range(50):
        spec = w.request(i)
        assert spec.prompt_tokens == len(spec.prompt.split())
        assert 20 <= spec.prompt_tokens <= 40


@pytest.mark.slow
def test_synthetic_prompts_have_exact_lengths_with_the_bundled_tokenizer():
    from pagedserve.backend.model_files import default_model_path
    from pagedserve.backend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    w = SyntheticWorkload(prompt_len_mean=100, prompt_len_range=50, seed=0, tokenizer=tokenizer)
    for i in range(20):
        spec = w.request(i)
        assert spec.prompt_tokens == len(spec.prompt.split()) == len(tokenizer.encode(spec.prompt))


def test_jsonl_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n{"prompt": "second"}\n')
    w = JsonlWorkload(path, output_len=9, seed=0)
    assert w.request(0) == RequestSpec(0, "hello there", 5)
    assert w.request(1) == RequestSpec(1, "second", 9)
    assert w.request(2).prompt == "hello there"  # cycles
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        JsonlWorkload(bad)


# --------------------------------------------------------------------------- requests and loops (fake transport)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedTransport:
    """Yields a scripted list of (seconds to wait, tokens) responses on a fake clock."""

    def __init__(self, clock: FakeClock, script: list[tuple[float, int]], fail_after: int | None = None):
        self.clock, self.script, self.fail_after = clock, script, fail_after
        self.seen: list[dict] = []

    async def stream(self, spec, sampling):
        self.seen.append(sampling)
        for n, (wait, tokens) in enumerate(self.script):
            if self.fail_after is not None and n == self.fail_after:
                raise loadgen.ServerError("server busy")
            self.clock.now += wait
            yield StreamChunk(tokens, prompt_tokens=12)


def test_send_one_times_each_token_bearing_response(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    transport = ScriptedTransport(clock, [(0.5, 1), (0.1, 0), (0.1, 2), (0.3, 1)])
    record = asyncio.run(runner.send_one(transport, RequestSpec(3, "p", 4), {"ignore_eos": True}, t0=99.0))
    assert transport.seen == [{"ignore_eos": True, "max_tokens": 4}]
    assert record.ok and record.start == pytest.approx(1.0) and record.scheduled == pytest.approx(1.0)
    assert record.ttft == pytest.approx(0.5)
    assert record.itl == pytest.approx([0.2, 0.3])  # the empty response folds into the next gap
    assert record.chunk_tokens == [1, 2, 1] and record.output_tokens == 4
    assert record.e2e == pytest.approx(1.0) and record.end == pytest.approx(2.0)
    assert record.prompt_tokens == 12  # the server's count wins


def test_send_one_records_an_error_instead_of_raising(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    transport = ScriptedTransport(clock, [(0.5, 1), (0.1, 1)], fail_after=1)
    record = asyncio.run(runner.send_one(transport, RequestSpec(0, "p", 4), {}, t0=100.0, scheduled=0.25))
    assert not record.ok and "server busy" in record.error
    assert record.e2e is None and record.end == pytest.approx(0.5) and record.scheduled == 0.25


class CountingTransport:
    def __init__(self, tokens: int = 3) -> None:
        self.in_flight = self.most = 0
        self.tokens = tokens

    async def stream(self, spec, sampling):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            for _ in range(sampling["max_tokens"]):
                await asyncio.sleep(0.001)
                yield StreamChunk(1)
        finally:
            self.in_flight -= 1


def test_closed_loop_keeps_the_concurrency_and_sends_every_request():
    transport = CountingTransport()
    workload = SyntheticWorkload(8, 2, output_len=3, seed=0)
    records = asyncio.run(runner._closed_loop(transport, workload, {}, 3, 10, None, 0, lambda r: None))
    assert [r.index for r in records] == list(range(10))
    assert transport.most == 3
    assert all(r.ok and r.output_tokens == 3 for r in records)


def test_closed_loop_for_a_duration_stops_sending_after_it():
    transport = CountingTransport()
    records = asyncio.run(runner._closed_loop(transport, SyntheticWorkload(8, 2, output_len=3), {}, 2, None, 0.2, 0, lambda r: None))
    assert records and max(r.start for r in records) < 0.25  # none sent after the duration (+ scheduling slack)


def test_open_loop_sends_on_the_poisson_schedule():
    transport = CountingTransport()
    done: list[RequestRecord] = []
    records = asyncio.run(runner._open_loop(transport, SyntheticWorkload(8, 2, output_len=2), {}, 200.0, 5, 20, None, done.append))
    expected = poisson_arrivals(200.0, 5, count=20)
    assert [r.scheduled for r in records] == expected
    assert len(done) == 20
    assert all(r.start >= r.scheduled - 1e-6 for r in records)
    assert math.isclose(records[-1].start, expected[-1], abs_tol=0.5)  # a busy machine delays the loop a little


def test_measured_requests_are_the_ones_a_run_sends_after_its_warm_up(monkeypatch):
    sent: list[RequestSpec] = []

    class Recording(CountingTransport):
        async def stream(self, spec, sampling):
            sent.append(spec)
            async for chunk in super().stream(spec, sampling):
                yield chunk

        async def close(self) -> None:
            pass

    monkeypatch.setattr(runner, "make_transport", lambda config: Recording())
    workload = SyntheticWorkload(8, 2, output_len=3, output_len_range=1, seed=4)
    config = loadgen.BenchConfig(num_requests=6, concurrency=2, warmup=2, tokenizer=None)
    result = asyncio.run(runner.run_benchmark_async(config, workload, progress=False))
    assert sorted(sent[2:], key=lambda spec: spec.index) == loadgen.measured_requests(config, workload)
    assert result.summary.client_cpu_s is not None and result.summary.client_cpu_s >= 0
    with pytest.raises(ValueError):
        loadgen.measured_requests(loadgen.BenchConfig(duration=5.0), workload)


def test_bench_config_validation():
    loadgen.BenchConfig().validate()
    for bad in (dict(protocol="udp"), dict(num_requests=0), dict(concurrency=0), dict(request_rate=-1.0),
                dict(duration=0.0), dict(output_len=0)):
        with pytest.raises(ValueError):
            loadgen.BenchConfig(**bad).validate()
    assert loadgen.BenchConfig(request_rate=2.0).mode == "open loop, 2 req/s"


def test_bench_cli_flags_build_the_config():
    import argparse

    from pagedserve.client.bench import add_bench_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--protocol", "http", "--request-rate", "1.5", "--output-len", "8", "--tokenizer", "none"])
    config = config_from_args(args)
    assert (config.url, config.protocol, config.request_rate, config.output_len, config.tokenizer) == (
        "localhost:8000", "http", 1.5, 8, None)
    assert args.run.__name__ == "run_bench"
