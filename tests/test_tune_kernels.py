"""benchmarks/tune_kernels.py, the sweep a lent GPU runs to write kernels/triton/configs/, dry-run
on CPU (`--device cpu`: tiny shapes, the kernels in Triton's interpreter): it writes a file the
engine reads, with a choice for every kernel it tunes, and a run cut short by its budget keeps
what an earlier run found."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep(out, *extra: str) -> dict:
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "tune_kernels.py"), "--device", "cpu", "--out", str(out),
               *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "cpu_dry_run.json").read_text())


def test_the_sweep_writes_a_file_the_engine_reads(tmp_path):
    from pagedserve.kernels.triton import tuned

    data = _sweep(tmp_path)
    assert data["complete"] and data["device"] == "cpu dry run"
    kernels = [item["key"]["kernel"] for item in data["choices"]]
    assert set(kernels) == {"w4a16", "fp8", "moe", "lora"}
    assert len(kernels) == 8 + 8 + 1 + 1  # 4 linears x M in (1, 16) x (int4, fp8), one MoE key, one LoRA key
    assert all(item["us"] <= item["default_us"] and item["tried"] >= 1 for item in data["choices"])
    configs = tuned.TunedConfigs.read(tmp_path / "cpu_dry_run.json")
    assert len(configs.entries) == len(kernels)

    cut = _sweep(tmp_path, "--budget", "0")  # nothing measured: the earlier run's choices stay
    assert not cut["complete"] and cut["choices"] == data["choices"]
