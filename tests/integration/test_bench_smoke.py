"""A short load-generator run against the real server: gRPC closed loop, HTTP open
loop, and `pagedserve bench` end to end with its JSON output."""

from __future__ import annotations

import json

from pagedserve.client.cli import main
from pagedserve.client.loadgen import BenchConfig, load_workload, run_benchmark

SMALL = dict(prompt_len_mean=16, prompt_len_range=4, output_len=6, output_len_range=2, warmup=1, seed=3)


def check(result, config: BenchConfig) -> None:
    s = result.summary
    assert s.num_errors == 0, s.error_examples
    assert s.num_ok == config.num_requests
    workload = load_workload(config)
    for record in result.records:
        spec = workload.request(record.index)
        assert record.output_tokens == record.requested_output_tokens == spec.max_tokens  # ignore_eos forces them
        assert record.prompt_tokens == spec.prompt_tokens  # the server counts what the client built
        assert 0 < record.ttft <= record.e2e
        assert sum(record.chunk_tokens) == record.output_tokens
        assert len(record.itl) == len(record.chunk_tokens) - 1
    assert s.output_tokens_per_s > 0 and s.requests_per_s > 0
    assert s.ttft.p50 <= s.e2e.p99
    assert s.total_output_tokens == sum(workload.request(i).max_tokens for i in range(config.num_requests))


def test_grpc_closed_loop(server):
    config = BenchConfig(url=server.grpc_url, protocol="grpc", num_requests=4, concurrency=2, **SMALL)
    check(run_benchmark(config, progress=False), config)


def test_http_open_loop(server):
    config = BenchConfig(url=server.http_url, protocol="http", num_requests=3, request_rate=4.0, **SMALL)
    result = run_benchmark(config, progress=False)
    check(result, config)
    assert all(r.start >= r.scheduled - 0.01 for r in result.records)


def test_cli_bench_writes_json(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--url", server.grpc_url, "--num-requests", "2", "--concurrency", "2", "--output-len", "4",
                 "--prompt-len-mean", "8", "--prompt-len-range", "0", "--warmup", "0", "--no-progress", "--json-out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "output tok/s" in printed
    data = json.loads(out.read_text())
    assert data["summary"]["num_ok"] == 2 and data["summary"]["total_output_tokens"] == 8
    assert len(data["requests"]) == 2 and data["config"]["concurrency"] == 2
