"""benchmarks/kill_cycles.py, short: a client process holding 32 gRPC streams, then one
holding 32 HTTP generate_stream connections, is killed with SIGKILL (a cycle each; the benchmark runs more); after
each the engine is idle again (0 KV blocks), tritonserver runs, is ready and answers. Then
the server is stopped with 32 streams in flight, and the stop ends in under 10 s."""

from __future__ import annotations

from benchmarks.kill_cycles import format_report, run_kill_cycles


def test_killed_clients_leave_a_healthy_server_and_a_stop_with_streams_in_flight_is_quick(tmp_path):
    report = run_kill_cycles(tmp_path, cycles=1, streams=32, progress=False)
    summary = format_report(report, 32)
    print(summary)
    assert len(report.cycles) == 2, summary
    assert all(c.answered == 32 for c in report.cycles), summary
    assert report.healthy, summary  # running, ready, answering, 0 KV blocks, no stub died
    assert report.stop_s is not None and report.stop_s < 10, summary
