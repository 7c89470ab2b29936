"""The soak test's code path (benchmarks/soak.py), short: 120 requests at concurrency 16, a
tenth of them fuzz cases (benchmarks/fuzz.py), against a tritonserver of its own whose python
stubs run under PYTHONMALLOC=debug (a Python-heap free without the GIL aborts a stub at once).

Passes when no request lost its final response, no stub aborted, no KV block is held
once the engine is idle, the server still answers, and the only errors are on
requests the client cancelled itself. Speed and RSS are reported, not asserted.
"""

from __future__ import annotations

from benchmarks.soak import SoakConfig, format_report, run_soak


def test_soak_short(tmp_path):
    config = SoakConfig(num_requests=120, concurrency=16, malloc_debug=True, sample_interval=5.0,
                        final_timeout=120.0, max_duration=150.0, workdir=str(tmp_path), fuzz_share=0.1)
    report = run_soak(config, progress=False)
    summary = format_report(report)
    print(summary)

    assert report.sent == 120, summary
    assert set(report.by_kind) == {"plain", "cancel", "logprobs", "fuzz"} and report.cancelled > 0, summary
    assert not report.lost_finals, summary
    assert not report.errors, summary  # errors on cancelled requests are counted apart
    assert not report.problems, summary  # logprobs / finish_reason / token counts as asked
    refused = report.by_kind["fuzz"].get("refused", 0)
    assert refused > 0 and report.completed + report.cancelled + refused == report.sent, summary
    assert not report.abort_lines and not report.stub_restarts and not report.process_died, summary
    assert report.kv_blocks_at_idle == 0, summary
    assert report.healthy, summary
