"""benchmarks/gpu.py, the one command a lent GPU runs, dry-run on CPU (`--device cpu --quick`,
a tiny random model): every section of it runs here (pagedserve in bf16, fp8 and int4, the
transformers peer, the served model under tritonserver), so it cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_runs_every_section_on_cpu(tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--device", "cpu", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["skipped"] == [], result["skipped"]
    ours = {row["model"]: row for row in result["rows"] if row["system"] == "pagedserve"}
    assert set(ours) == {"tiny bf16", "tiny fp8", "tiny int4"}
    for row in ours.values():
        assert row["decode_tok_s"] > 0 and row["offline_tok_s"] > 0 and row["ttft_2k_ms"] > 0
    assert ours["tiny bf16"]["offline_at_served_tok_s"] > 0
    assert ours["tiny bf16"]["grammar_mask_share"] > -1  # measured where xgrammar is installed (here; a GPU machine: carried)
    systems = {row["system"] for row in result["rows"]}
    assert {"transformers continuous batching", "transformers static cache, compiled"} <= systems
    served = next(row for row in result["rows"] if "served_tok_s" in row)
    assert served["served_tok_s"] > 0 and served["served_requests"] > 0
    assert [(row["experts"], row["tokens"]) for row in result["moe"]] == [
        (form, tokens) for form in ("bf16", "fp8", "int4", "mxfp4") for tokens in (1, 256)]
    assert all(row["ref_ms"] > 0 for row in result["moe"])
    assert [row["run"] for row in result["lora_mix"]] == ["LoRA off, base model", "LoRA on, base model",
                                                         "LoRA on, one adapter", "LoRA on, 4 adapters mixed"]
    assert all(row["tok_s"] > 0 for row in result["lora_mix"]) and all(row["ref_ms"] > 0 for row in result["lora_kernel"])
    off, on = result["deterministic"]
    assert (off["deterministic"], on["deterministic"]) == (False, True) and on["single_tok_s"] > 0 and on["batch_tok_s"] > 0
    assert on["differs_at"] is None  # beside 15 others as alone (here the CPU backend's setting; on a GPU the Triton launches)
    assert len(result["targets"]) == 9  # every target has its line (NOT MEASURED on a tiny model)
    assert (tmp_path / "gpu.md").read_text().count("| pagedserve |") == 3
