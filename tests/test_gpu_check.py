"""benchmarks/gpu.py, the one command a lent GPU runs, dry-run on CPU (`--device cpu --quick`,
a tiny random model): every section of it runs here (the kernel table, pagedserve in bf16, fp8 and
int4, the step profile, the speculative steps, a one-image request, the transformers peer, the served model under tritonserver), so it cannot
rot between GPU runs."""

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
    kernels = result["kernels"]  # one tiny shape at M 1 and 16; our Triton kernels through the interpreter
    kinds = {("bf16", False), ("fp8", False), ("fp8", True), ("int4", False), ("int4", True)}  # True: the vendor's
    assert sorted((row["family"], row["vendor"], row["m"]) for row in kernels) == sorted(
        (family, vendor, m) for family, vendor in kinds for m in (1, 16))
    assert all(row["us"] > 0 and row["gb_s"] > 0 for row in kernels if not row["vendor"]), kernels
    vendor = {row["family"]: row for row in kernels if row["vendor"] and row["m"] == 16}
    assert vendor["fp8"]["us"] > 0 and vendor["fp8"]["diff_vs_ours"] < 0.05  # torch._scaled_mm has a CPU kernel
    assert vendor["int4"]["us"] is None and "absent on cpu" in vendor["int4"]["note"]  # tinygemm: CUDA only
    assert all(row["vendor_over_ours"] > 0 for row in kernels if row["family"] == "fp8" and not row["vendor"])
    profiled = {row["scenario"]: row for row in result["step_profile"]}
    assert len(profiled) == 4 and {"decode, batch 1", "decode, batch 64", "decode, batch 256"} < set(profiled)
    for row in profiled.values():
        assert row["steps"] > 0 and row["wall_us"] > 0 and row["kernels"] > 0 and row["note"] is None, row
        assert abs(sum(part["share"] for part in row["families"].values()) - 1) < 1e-3, row
    spec = result["spec"]  # a verify step and a plain one at batch 1, n-gram on a repeated text
    assert spec["plain_step_ms"] > 0 and spec["verify_step_ms"] > 0 and spec["ngram_tok_s"] > 0 and spec["drafted"] > 0
    assert spec["draft_step_ms"] > 0 and spec["draft_forward_ms"] > 0 and spec["draft_first_forward_ms"] > 0
    vision = {row["what"]: row["ms"] for row in result["vision"]["rows"]}  # a one-image request, the tiny Qwen2.5-VL
    assert len(vision) == 6 and all(ms > 0 for ms in vision.values()) and result["vision"]["image_tokens"] > 0
    assert len(result["targets"]) == 11  # every target has its line (NOT MEASURED on a tiny model)
    assert [verdict for verdict, _ in result["targets"][-2:]] == ["NOT MEASURED"] * 2  # these want the 8B shapes
    table = (tmp_path / "gpu.md").read_text()
    assert table.count("| pagedserve |") == 3
    assert "| tiny (256 x 256) | 16 |" in table and "| decode, batch 256 |" in table
