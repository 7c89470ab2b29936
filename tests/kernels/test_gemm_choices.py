"""The quantized GEMMs' timed choice (kernels/triton/gemm.py): timed once per key, kept on
disk per GPU model so a restarted server reuses it, and a stored choice that is no longer a
candidate is timed again."""

from __future__ import annotations

import torch

from .gemm_checks import needs_triton  # noqa: F401 - first: sets TRITON_INTERPRET=1 without CUDA


def test_a_timed_choice_is_stored_and_reused_by_the_next_process(tmp_path, monkeypatch):
    from pagedserve.kernels.triton import gemm as gt

    monkeypatch.setattr(gt, "_choices_file", lambda device: str(tmp_path / "gemm_choices" / "gpu.json"))
    monkeypatch.setattr(gt, "_TUNED", {})
    key = ("w4a16", torch.device("cuda", 0), 16, 4096, 4096, 128, torch.bfloat16, False)
    fast, slow = gt.GemmConfig(16, 64, 128), gt.GemmConfig(16, 128, 128, split_k=1)
    gt._store_choice(key, fast)
    assert gt._stored_choice(key, [slow, fast]) == fast
    monkeypatch.setattr(gt, "_TUNED", {})  # a new process: nothing timed in memory
    timed = []
    assert gt.timed_choice(key, [slow, fast], timed.append) == fast and timed == []
    assert gt._stored_choice(key, [slow]) is None  # not a candidate any more: timed again
    cpu_key = ("w4a16", torch.device("cpu"), 16, 4096, 4096, 128, torch.bfloat16, False)
    gt._store_choice(cpu_key, fast)
    assert gt._stored_choice(cpu_key, [fast]) is None  # only GPU choices are kept
