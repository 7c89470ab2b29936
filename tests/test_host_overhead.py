"""benchmarks/host_overhead.py: the host's CPU per engine step, by phase, for the CUDA
engine's host path (decode graphs' buffers, persistent rows, async scheduling) and the CPU
engine's; both run here in a few steps so the benchmark cannot rot."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", ["gpu", "cpu"])
def test_every_phase_is_timed_and_the_phases_add_up(path, capsys):
    import host_overhead

    rows = host_overhead.main(["--running", "1,4", "--steps", "5", "--path", path])
    assert [row["running"] for row in rows] == [1, 4]
    for row in rows:
        phases = sum(row[p] for p in host_overhead.PHASES)
        assert 0 < phases <= row["total"] * 1.5 + 0.05  # medians of parts, near the median whole
        assert row["prepare"] > 0 and row["schedule"] > 0 and row["render"] > 0
    assert "| running requests | host ms / step |" in capsys.readouterr().out
