"""benchmarks/serving.py's report: the ratios a reader takes from a run (served over
offline, pagedserve over vLLM), per round and, with --rounds, their mean and range."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after everything: its scripts shadow nothing

import serving  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

from pagedserve.client.loadgen import RequestRecord, summarize  # noqa: E402


def point(system: str, tokens_per_s: float, round_number: int, ttft: float = 1.0) -> serving.Point:
    """A closed-loop point at concurrency 32: one request of `tokens_per_s` tokens over 1 s."""
    record = RequestRecord(0, 0.0, 0.0, end=1.0, ttft=ttft, e2e=1.0, output_tokens=int(tokens_per_s))
    return serving.Point(system, "closed", 32.0, summarize([record]), 1.0, round_number)


def runs(rounds: dict[str, list[float]]) -> list[serving.SystemRun]:
    return [serving.SystemRun(system, points=[point(system, value, i + 1) for i, value in enumerate(values)])
            for system, values in rounds.items()]


def test_each_round_runs_every_system_in_a_rotated_order():
    systems = ["offline", "inflight", "vllm"]
    assert serving.round_order(systems, 1) == systems
    assert serving.round_order(systems, 2) == ["inflight", "vllm", "offline"]
    assert serving.round_order(systems, 4) == systems


def test_each_round_gets_its_own_ratios_and_the_rounds_a_mean_and_range():
    lines = serving.references(runs({"offline": [400.0, 360.0], "inflight": [340.0, 324.0], "vllm": [300.0, 300.0]}))
    text = "\n".join(lines)
    assert "- concurrency 32, round 1: served / offline 0.850 (340 vs 400 tok/s); pagedserve / vLLM throughput 1.13x" in text
    assert "- concurrency 32, round 2: served / offline 0.900 (324 vs 360 tok/s); pagedserve / vLLM throughput 1.08x" in text
    assert ("- concurrency 32: served / offline 0.875 (0.850-0.900, 2 rounds); pagedserve / vLLM throughput 1.11 "
            "(1.08-1.13, 2 rounds); TTFT p99 vs vLLM 1.00 (1.00-1.00, 2 rounds).") in text


def test_a_single_round_reports_without_round_labels():
    text = "\n".join(serving.references(runs({"offline": [400.0], "inflight": [340.0]})))
    assert "- concurrency 32: served / offline 0.850 (340 vs 400 tok/s)." in text
    assert "round" not in text


def test_the_headline_averages_throughput_over_the_rounds():
    lines = serving.headline(runs({"inflight": [340.0, 320.0], "vllm": [300.0, 300.0]}))
    assert lines[0].startswith("At concurrency 32, in-flight batching delivers 330 output tok/s (mean of the rounds): ")
    assert "(its OpenAI server) 1.1x" in lines[0]


def test_the_core_table_shows_each_parts_cpu_per_output_token():
    from core_accounting import CoreUse, ThreadTime

    served = point("inflight", 400.0, 1)
    served.cores = CoreUse(2.0, {"engine": ThreadTime(3.6, 0.4), "response thread": ThreadTime(0.04),
                                 "tritonserver": ThreadTime(0.06), "load generator": ThreadTime(0.08)})
    offline = point("offline", 450.0, 1)
    offline.cores = CoreUse(2.0, {"engine": ThreadTime(3.98, 0.02)})
    lines = serving.core_table([serving.SystemRun("offline", points=[offline]), serving.SystemRun("inflight", points=[served])])
    text = "\n".join(lines)
    assert "| pagedserve offline (in-process, same requests) | 32 | 450.0 | 1.99 | 0.01 | 8844 | - | - | - | - |" in text
    assert "| pagedserve in-flight batching | 32 | 400.0 | 1.80 | 0.20 | 9000 | 100 | - | 150 | 200 |" in text
    assert serving.core_table(runs({"inflight": [400.0]})) == []  # not read (another OS, or vLLM's points)


def test_a_system_waits_for_the_last_ones_spinning_and_says_when_it_gave_up():
    """A process still spinning after its turn (vLLM's offline engine's workers do, ~1 s) is
    waited out, up to a limit; past it the report says the machine stayed busy."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    lines: list[str] = []
    try:
        time.sleep(0.3)
        busy = serving.wait_until_quiet("vllm", lines.append, longest_s=1.0)
    finally:
        spinner.kill()
        spinner.wait()
    if busy is None:
        pytest.skip("reads Linux /proc/stat: nothing to read, nothing waited for")
    assert busy > 0.25 and lines and "stayed busy" in lines[0]
