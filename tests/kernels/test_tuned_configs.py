"""Kernel choices committed per GPU (kernels/triton/tuned.py): a device's file is read and its
choice is what launches, never timed; without a file the launchers' heuristics run unchanged; a
malformed file names itself and its entry; every committed file is well formed."""

from __future__ import annotations

import json

import pytest
import torch

from .gemm_checks import needs_triton, rel_err  # noqa: F401 - first: sets TRITON_INTERPRET=1 without CUDA

pytestmark = needs_triton


@pytest.fixture
def committed(tmp_path, monkeypatch):
    """Install a committed file of `choices` for every device (the CPU's too, as a GPU's)."""
    from pagedserve.kernels.triton import gemm, tuned

    monkeypatch.setattr(gemm, "_TUNED", {})
    monkeypatch.setattr(tuned, "_CHOSEN", {})

    def install(choices, name="Test GPU"):
        path = tmp_path / tuned.file_name(name)
        path.write_text(json.dumps({"device": name, "triton": "0", "choices": choices}))
        configs = tuned.TunedConfigs.read(path)
        monkeypatch.setattr(tuned, "for_device", lambda device: configs)
        return configs

    return install


def _recording(monkeypatch, module):
    """The configs `module._launch` is called with."""
    seen = []
    launch = module._launch

    def spy(*args, **kwargs):
        seen.append(next(a for a in args if hasattr(a, "block_m")))
        return launch(*args, **kwargs)

    monkeypatch.setattr(module, "_launch", spy)
    return seen


def test_file_names_follow_the_device_name():
    from pagedserve.kernels.triton.tuned import file_name

    assert file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert file_name("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100-SXM4-80GB.json"


def test_a_committed_int4_choice_is_what_launches_and_is_never_timed(committed, monkeypatch):
    from pagedserve.kernels.int4 import quantize_int4, w4a16_matmul_ref
    from pagedserve.kernels.triton import gemm, int4, tuned

    n, k, group = 96, 256, 64
    w = quantize_int4(torch.randn(n, k) * 0.02, group)
    x = torch.randn(3, k).to(torch.bfloat16)
    chosen = gemm.GemmConfig(16, 32, 32, 4, 2, split_k=2)  # not a candidate of the interpreter's
    key = ("w4a16", x.device, 4, n, k, group, torch.bfloat16, False)
    committed([tuned.entry(key, chosen, us=1.0)])
    seen = _recording(monkeypatch, int4)
    monkeypatch.setattr(gemm, "_store_choice", lambda *a: pytest.fail("a committed choice is not stored again"))
    y = int4.w4a16_matmul_triton(x, w)
    assert seen == [chosen]
    assert rel_err(y, w4a16_matmul_ref(x, w)) < 1e-2
    other_m = torch.randn(9, k).to(torch.bfloat16)  # M bucket 16: not in the file, the heuristics' first candidate
    int4.w4a16_matmul_triton(other_m, w)
    assert seen[1] == int4._candidates(9, n, k, group)[0]


def test_a_committed_choice_equal_to_a_candidate_is_that_candidate(committed):
    """fp8's SCALED_MM is told apart by identity: a committed copy of it must come back as it."""
    from pagedserve.kernels.triton import fp8, tuned

    key = ("fp8", torch.device("cpu"), 16, 4096, 4096, torch.bfloat16, "fp8", False, 0, torch.float8_e4m3fn)
    committed([tuned.entry(key, fp8.SCALED_MM)])
    assert tuned.committed_choice(key, [fp8.GemmConfig(16, 64, 128), fp8.SCALED_MM]) is fp8.SCALED_MM


def test_a_committed_fp8_choice_launches(committed, monkeypatch):
    from pagedserve.kernels.fp8 import fp8_matmul_ref, quantize_fp8
    from pagedserve.kernels.triton import fp8, gemm, tuned

    n, k = 80, 256
    w = quantize_fp8(torch.randn(n, k) * 0.02)
    x = torch.randn(2, k).to(torch.float16)
    chosen = gemm.GemmConfig(16, 16, 64, 4, 2, split_k=2)
    key = ("fp8", x.device, 2, n, k, torch.float16, "w8a16", False, 0, torch.float8_e4m3fn)
    committed([tuned.entry(key, chosen)])
    seen = _recording(monkeypatch, fp8)
    y = fp8.fp8_matmul_triton(x, w, mode="w8a16")
    assert seen == [chosen]
    assert rel_err(y, fp8_matmul_ref(x, w)) < 1e-3


def test_a_committed_lora_choice_launches_and_adds_the_same_delta(committed):
    from pagedserve.kernels.lora import add_lora_ref
    from pagedserve.kernels.triton import gemm, lora, tuned

    tokens, slots, rank, width_in, width_out = 5, 2, 8, 128, 160
    x = torch.randn(tokens, width_in).to(torch.bfloat16)
    a = (torch.randn(slots, rank, width_in) * 0.1).to(torch.bfloat16)
    b = (torch.randn(slots, width_out, rank) * 0.1).to(torch.bfloat16)
    scaling = torch.tensor([0.5, 2.0])
    token_slots = torch.tensor([0, 1, -1, 1, 0])
    chosen = gemm.GemmConfig(16, 128, 32, 4, 3)
    default = lora.lora_config(tokens, slots)
    key = ("lora", x.device, 8, default.block_m, slots, rank, width_in, width_out, torch.bfloat16)
    committed([tuned.entry(key, chosen)])
    assert lora._config(x, slots, rank, width_out, None) == chosen
    base = torch.randn(tokens, width_out).to(torch.bfloat16)
    got = lora.add_lora_triton(base.clone(), x, a, b, scaling, token_slots)
    want = add_lora_ref(base.clone(), x, a, b, scaling, token_slots)
    assert rel_err(got, want) < 1e-2


def test_without_a_file_the_heuristics_run_unchanged(tmp_path):
    from pagedserve.kernels.triton import gemm, lora, tuned

    configs = tuned.for_device_name("A GPU nobody tuned", str(tmp_path))
    assert configs.entries == {}
    key = ("w4a16", torch.device("cpu"), 1, 64, 64, 32, torch.bfloat16, False)
    assert configs.lookup(key) is None
    assert tuned.for_device(torch.device("cpu")).entries == {}  # off CUDA no file is read at all
    assert tuned.choice(key, [gemm.GemmConfig(16, 64, 64), gemm.GemmConfig(16, 32, 64)]) == gemm.GemmConfig(16, 64, 64)
    assert lora._config(torch.zeros(3, 64, dtype=torch.bfloat16), 2, 8, 64, None) == lora.lora_config(3, 2)


def test_a_malformed_file_names_itself_and_the_entry(tmp_path):
    from pagedserve.kernels.triton import tuned

    path = tmp_path / "Bad_GPU.json"
    path.write_text(json.dumps({"choices": [{"key": {"kernel": "w4a16", "m": 1, "n": 64, "k": 64, "group": 32,
                                                     "dtype": "bfloat16", "bias": False},
                                             "config": {"block_m": 16, "blocks_n": 64}}]}))
    with pytest.raises(ValueError, match=r"Bad_GPU.json: choice 0 .*blocks_n.*tune_kernels"):
        tuned.TunedConfigs.read(path)


class _Stop(Exception):
    pass


def test_every_launchers_key_has_the_fields_the_files_name(monkeypatch):
    """The key each launcher (int4, fp8, MoE, LoRA) builds, against `KEY_FIELDS`: a field added to
    a launcher's key without its name here would make every committed entry miss silently."""
    from pagedserve.kernels.fp8 import quantize_fp8
    from pagedserve.kernels.int4 import quantize_int4
    from pagedserve.kernels.moe import ExpertWeights
    from pagedserve.kernels.triton import fp8, int4, lora, moe, tuned

    keys = []

    def record(key, candidates, *run):
        keys.append(tuned.named(key))  # ValueError where the fields do not match
        raise _Stop

    for module, name in ((int4, "timed_choice"), (fp8, "timed_choice"), (moe, "timed_choice"), (lora, "choice")):
        monkeypatch.setattr(module, name, record)
    x = torch.randn(2, 64).to(torch.bfloat16)
    calls = [
        lambda: int4.w4a16_matmul_triton(x, quantize_int4(torch.randn(32, 64), 32)),
        lambda: fp8.fp8_matmul_triton(x, quantize_fp8(torch.randn(32, 64)), mode="w8a16"),
        lambda: moe.fused_moe_triton(x, ExpertWeights(torch.randn(4, 64, 64).to(torch.bfloat16),
                                                      torch.randn(4, 64, 32).to(torch.bfloat16)),
                                     torch.ones(2, 2), torch.tensor([[0, 1], [2, 3]])),
        lambda: lora.add_lora_triton(torch.zeros(2, 48, dtype=torch.bfloat16), x, torch.zeros(2, 8, 64, dtype=torch.bfloat16),
                                     torch.zeros(2, 48, 8, dtype=torch.bfloat16), torch.ones(2), torch.tensor([0, 1])),
    ]
    for call in calls:
        with pytest.raises(_Stop):
            call()
    assert [key["kernel"] for key in keys] == ["w4a16", "fp8", "moe", "lora"]
    assert keys[0]["n"] == 32 and keys[0]["k"] == 64 and keys[2]["experts"] == 4 and keys[3]["width_out"] == 48


def test_every_committed_file_is_well_formed():
    """What the sweep committed (kernels/triton/configs/*.json) parses, names known kernels, and
    every tile is one the kernels can launch (power-of-two blocks, K tiles inside a group)."""
    from pagedserve.kernels.triton import tuned

    for path in sorted(tuned.CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        assert {"device", "triton", "choices"} <= set(data), path.name
        tuned.TunedConfigs.read(path)
        for item in data["choices"]:
            key, config = item["key"], tuned.config_from(item["config"])
            assert set(key) == {"kernel", *tuned.KEY_FIELDS[key["kernel"]]}, (path.name, key)
            if config.variant in ("dequant", "") and config.block_m == 0:
                continue  # a whole-matmul candidate (cuBLAS after a dequantization, torch._scaled_mm)
            for size in (config.block_m, config.block_n, config.block_k):
                assert size >= 1 and size & (size - 1) == 0, (path.name, key, config)
            if key.get("group"):
                assert key["group"] % config.block_k == 0, (path.name, key, config)
