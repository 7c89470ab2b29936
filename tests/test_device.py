"""dtype auto follows what this CPU computes fastest: never bf16 where the flags show no
native bf16 math (oneDNN emulates it there, at about half of float32's speed), and where
they do, what the matmul probe measured (the same flag meant slower bf16 on a Xeon and
2-6x faster bf16 on an AMD EPYC)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.backend import device
from pagedserve.backend.cpu import matmul_probe
from pagedserve.backend.cpu.matmul_probe import MatmulTimes
from pagedserve.backend.model_config import ModelConfig

AVX512_ONLY = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n"
AVX512_BF16_NO_AMX = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
CONFIG = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64)


def test_native_bf16_is_read_from_the_cpu_flags():
    assert device.native_bf16_flags(AVX512_ONLY) == []
    assert device.native_bf16_flags(SAPPHIRE_RAPIDS) == ["avx512_bf16", "amx_bf16"]
    assert device.native_bf16_flags(GRAVITON3) == ["bf16"]
    assert device.native_bf16_flags("") == []


def test_auto_picks_float32_on_an_emulating_cpu_without_measuring(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpuinfo", lambda: AVX512_ONLY)
    monkeypatch.setattr(matmul_probe, "matmul_times", lambda config: pytest.fail("no probe without native bf16"))
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert device.resolve_dtype("auto", torch.device("cpu"), CONFIG) == torch.float32
    assert "no native bf16" in caplog.text


@pytest.mark.parametrize("cpu", [AVX512_BF16_NO_AMX, SAPPHIRE_RAPIDS, GRAVITON3])
@pytest.mark.parametrize("bf16_ms, expected", [(0.2, torch.bfloat16), (0.9, torch.float32)])
def test_auto_takes_the_dtype_the_probe_measured_faster_and_says_so(monkeypatch, caplog, cpu, bf16_ms, expected):
    monkeypatch.setattr(device, "cpuinfo", lambda: cpu)
    times = MatmulTimes(64, 256, bfloat16=bf16_ms / 1e3, float32_transposed=0.8e-3, float32_onednn=0.5e-3)
    monkeypatch.setattr(matmul_probe, "matmul_times", lambda config: times)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert device.resolve_dtype("auto", torch.device("cpu"), CONFIG) == expected
    assert f"dtype auto: {str(expected).removeprefix('torch.')}" in caplog.text
    assert f"bfloat16 {bf16_ms:.2f} ms" in caplog.text and "0.50 ms packed (oneDNN)" in caplog.text


def test_auto_weighs_bf16_against_the_checkpoints_own_blocks_where_float32_runs_through_them(monkeypatch, caplog):
    """A GGUF Q4_1 checkpoint (the bundled model): float32 engines multiply its blocks, so bf16
    beating oneDNN's float32 does not make it the faster dtype."""
    monkeypatch.setattr(device, "cpuinfo", lambda: AVX512_BF16_NO_AMX)
    times = MatmulTimes(64, 256, bfloat16=0.3e-3, float32_transposed=0.8e-3, float32_onednn=0.5e-3,
                        float32_blocks=0.2e-3)
    monkeypatch.setattr(matmul_probe, "matmul_times", lambda config: times)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert device.resolve_dtype("auto", torch.device("cpu"), CONFIG) == torch.float32
    assert "0.20 ms GGUF blocks" in caplog.text


def test_an_explicit_dtype_is_taken_as_given(monkeypatch):
    monkeypatch.setattr(matmul_probe, "matmul_times", lambda config: pytest.fail("no probe for an explicit dtype"))
    assert device.resolve_dtype("bfloat16", torch.device("cpu"), CONFIG) == torch.bfloat16
    assert device.resolve_dtype("float32", torch.device("cpu"), CONFIG) == torch.float32


def test_gpu_memory_a_released_engine_left_in_torchs_cache_counts_as_free(monkeypatch):
    """A second engine in one process (a notebook rebuilding it, a test after another) gets
    the memory the first one's KV cache gave back, though the driver still counts it taken."""
    from pagedserve.backend.config import EngineConfig
    from pagedserve.backend.errors import ConfigError

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (2 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 70 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 1 * gib)
    config = EngineConfig(gpu_memory_utilization=0.9)
    per_block = device.kv_block_bytes(CONFIG, config.block_size, torch.float32)
    blocks = device.num_kv_blocks(config, CONFIG, torch.device("cuda"), torch.float32)
    assert blocks == int((2 + 69 - 8) * gib // per_block)

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 1 * gib)  # nothing cached: 2 GiB < the 8 kept back
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        device.num_kv_blocks(config, CONFIG, torch.device("cuda"), torch.float32)
