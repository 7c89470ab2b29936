"""The matmul probe measures each candidate once per machine and shape, and a restart
reads its verdict from the cache instead of measuring again."""

from __future__ import annotations

from pagedserve.backend.cpu import matmul_probe
from pagedserve.backend.model_config import ModelConfig

CONFIG = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64)


def test_the_probe_times_the_gate_up_shape_and_caches_its_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    matmul_probe._measured.clear()
    times = matmul_probe.matmul_times(CONFIG)
    assert (times.in_features, times.out_features) == (64, 2 * 96)
    assert 0 < times.bfloat16 < 1 and 0 < times.float32_transposed < 1 and 0 < times.float32_onednn < 1
    assert times.float32 == min(times.float32_transposed, times.float32_onednn)  # the layout engines run

    monkeypatch.setattr(matmul_probe, "measure", lambda *shape: (_ for _ in ()).throw(AssertionError("measured")))
    assert matmul_probe.matmul_times(CONFIG) == times  # this process's verdict
    matmul_probe._measured.clear()  # as a restart
    assert matmul_probe.matmul_times(CONFIG) == times  # read back from the cache file
    matmul_probe._measured.clear()
    (tmp_path / matmul_probe.CACHE_FILE).write_text("not json")
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert matmul_probe.matmul_times(CONFIG).in_features == 64  # a broken cache only means measuring again


def test_a_checkpoint_of_gguf_blocks_is_timed_through_them_under_a_key_of_its_own(tmp_path, monkeypatch):
    from dataclasses import replace

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    matmul_probe._measured.clear()
    plain = matmul_probe.matmul_times(CONFIG)
    blocks = matmul_probe.matmul_times(replace(CONFIG, source_block_format="q4_1"))
    assert plain.float32_blocks is None and 0 < blocks.float32_blocks < 1
    assert blocks.float32 == blocks.float32_blocks  # what float32 engines of that checkpoint run
    assert "GGUF blocks" in blocks.summary() and "GGUF blocks" not in plain.summary()


def test_a_huge_weight_is_probed_at_a_bounded_size():
    big = ModelConfig("llama", vocab_size=256, hidden_size=8192, intermediate_size=28672, num_layers=2, num_heads=64,
                      num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64)
    in_features, out_features = matmul_probe.probe_shape(big)
    assert in_features == 8192 and in_features * out_features <= matmul_probe.MAX_PROBE_ELEMENTS


def test_float32_layouts_follow_the_faster_measurement_and_the_fp8_cache(monkeypatch):
    import torch

    from pagedserve.backend.cpu.linear_methods import WeightLayouts

    def probed(transposed: float, onednn: float) -> None:
        times = matmul_probe.MatmulTimes(64, 192, bfloat16=1.0, float32_transposed=transposed, float32_onednn=onednn)
        monkeypatch.setattr(matmul_probe, "matmul_times", lambda config: times)

    cpu = torch.device("cpu")
    probed(transposed=1.0, onednn=2.0)
    assert matmul_probe.weight_layouts(CONFIG, torch.float32, cpu, fp8_kv_cache=False) == WeightLayouts()
    probed(transposed=2.0, onednn=1.0)
    monkeypatch.setattr(matmul_probe.gemv_cpu.LIBRARY, "get", lambda: object())  # the C GEMV is built
    assert matmul_probe.weight_layouts(CONFIG, torch.float32, cpu, fp8_kv_cache=False) == WeightLayouts("both", "both")
    assert matmul_probe.weight_layouts(CONFIG, torch.float32, cpu, fp8_kv_cache=True) == WeightLayouts("transposed", "both")
    assert matmul_probe.weight_layouts(CONFIG, torch.bfloat16, cpu, fp8_kv_cache=False) == WeightLayouts()


def test_decoder_layers_keep_a_plain_copy_only_where_it_fits_and_the_gemv_is_built(monkeypatch):
    import torch

    from pagedserve.backend.cpu.linear_methods import WeightLayouts

    times = matmul_probe.MatmulTimes(64, 192, bfloat16=1.0, float32_transposed=2.0, float32_onednn=1.0)
    monkeypatch.setattr(matmul_probe, "matmul_times", lambda config: times)
    monkeypatch.setattr(matmul_probe.gemv_cpu.LIBRARY, "get", lambda: object())
    cpu = torch.device("cpu")
    copy = matmul_probe.decoder_weight_bytes(CONFIG)
    monkeypatch.setattr(matmul_probe, "physical_memory", lambda: int(copy / matmul_probe.PLAIN_COPY_MAX_MEMORY) - 1)
    assert matmul_probe.weight_layouts(CONFIG, torch.float32, cpu, fp8_kv_cache=False) == WeightLayouts("onednn", "both")
    monkeypatch.setattr(matmul_probe.gemv_cpu.LIBRARY, "get", lambda: None)  # no C compiler: MKL for one row
    assert matmul_probe.weight_layouts(CONFIG, torch.float32, cpu, fp8_kv_cache=False) == WeightLayouts("onednn", "transposed")
