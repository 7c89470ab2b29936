"""dtype auto follows the CPU's own bf16 math, not what oneDNN claims (it emulates bf16 on
any AVX-512 CPU, at about half of float32's speed)."""

from __future__ import annotations

import logging

import torch

from pagedserve.backend import device

AVX512_ONLY = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n"
AVX512_BF16_NO_AMX = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert device.native_bf16_flags(AVX512_ONLY) == []
    assert device.native_bf16_flags(SAPPHIRE_RAPIDS) == ["avx512_bf16", "amx_bf16"]
    assert device.native_bf16_flags(GRAVITON3) == ["bf16"]
    assert device.native_bf16_flags("") == []


def test_auto_picks_float32_on_an_emulating_cpu_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpuinfo", lambda: AVX512_ONLY)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert device.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "no native bf16" in caplog.text
    monkeypatch.setattr(device, "cpuinfo", lambda: SAPPHIRE_RAPIDS)
    assert device.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(device, "cpuinfo", lambda: GRAVITON3)
    assert device.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_auto_picks_float32_with_avx512_bf16_but_no_amx_and_says_why(monkeypatch, caplog):
    """There bf16 matmuls are slower than float32's past a few dozen rows (measured offline: 232 vs 280 tok/s)."""
    monkeypatch.setattr(device, "cpuinfo", lambda: AVX512_BF16_NO_AMX)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert device.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "avx512_bf16 but no AMX" in caplog.text
    assert device.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert device.resolve_dtype("float32", torch.device("cpu")) == torch.float32
