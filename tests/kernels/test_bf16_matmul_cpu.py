"""The C bf16 matmul (kernels/cpu/bf16_matmul.py) against a float64 product of the same bf16
values.

Sums are float32 and the result is rounded once to bf16, so each output is within half a bf16
step (2**-9 relative) of the exact sum plus the float32 sums' error: 2**-8 of the sum of
|x_i w_i| (and |bias|) bounds it, at every row count (whole tiles, leftover rows, several passes
of rows) and for output counts that are not whole panels or groups. Run on every instruction
set: its plain loop (any CPU) and the VDPBF16PS tiles engines use (natively where the CPU has
AVX512-BF16, else emulated by SIMDe: tests/kernels/instruction_sets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu
from pagedserve.kernels.cpu.bf16_matmul import pack_pairs, pair_matmul
from .instruction_sets import march_for
from .threads import same_on_one_thread

built = pytest.mark.skipif(bf16_matmul_cpu.LIBRARY.get() is None,
                           reason="the C matmul is not built here (no C compiler)")


def test_pairs_hold_the_weight_bit_for_bit_padded_with_zeros():
    weight = torch.randn(21, 64).bfloat16()
    packed = pack_pairs(weight, torch.randn(21))
    assert packed.pairs.shape == (2, 32, 16) and packed.shape == (21, 64)  # 21 outputs in two groups of 16
    assert torch.equal(packed.unpack(), weight)
    # output 16 g + n's inputs 2k, 2k + 1 are pairs[g, k, n]'s low and high halves
    halves = packed.pairs.view(torch.bfloat16).view(2, 32, 16, 2)
    assert torch.equal(halves[0, 5, 3], weight[3, 10:12])
    assert not halves[1, :, 5:].view(torch.int16).any() and not packed.bias[21:].any()
    assert pack_pairs(torch.randn(16, 63).bfloat16()) is None  # an odd number of inputs
    assert pack_pairs(torch.randn(16, 64)) is None  # not bf16


def assert_matches(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    out = pair_matmul(x, pack_pairs(weight, bias))
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (x.shape[0], weight.shape[0])
    b = None if bias is None else bias.double()
    exact = torch.nn.functional.linear(x.double(), weight.double(), b)
    scale = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.abs())
    error = (out.double() - exact).abs() / scale
    assert error.max().item() <= 2**-8, error.max().item()


@built
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 130])
@pytest.mark.parametrize("out_features", [16, 50, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_products_within_one_bf16_rounding(rows, out_features, bias):
    g = torch.Generator().manual_seed(rows * out_features + bias)
    x = torch.randn(rows, 192, generator=g).bfloat16()
    weight = torch.randn(out_features, 192, generator=g).bfloat16()
    assert_matches(x, weight, torch.randn(out_features, generator=g) if bias else None)


@built
@pytest.mark.parametrize("variant", ["x86-64", "avx2", "avx512", "native", "avx512bf16", "amx"])
def test_every_instruction_set_the_cpu_runs_computes_the_same_products(variant, monkeypatch):
    """The plain loop (x86-64), the weights widened to float32 (AVX2, AVX-512: `deterministic`'s
    path on CPUs without AVX512-BF16), the CPU's own code, the AVX512-BF16 tiles (natively, or
    emulated by SIMDe where the CPU lacks them: tests/kernels/instruction_sets.py) and AMX's
    (natively only). 320 inputs go to AMX's tiles where built, 336 (not a whole tile's 32) never do."""
    library = bf16_matmul_cpu.LIBRARY.load(march="native" if variant == "native" else march_for(variant))
    monkeypatch.setattr(bf16_matmul_cpu.LIBRARY, "get", lambda: library)
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    assert library.bf16_matmul_native() == (variant in ("avx512bf16", "amx") or (variant == "native" and "avx512_bf16" in flags))
    if variant == "amx" or (variant == "native" and "amx_bf16" in flags):
        if not bf16_matmul_cpu.uses_tiles(library):
            pytest.skip("Linux did not grant this process AMX's tile state (arch_prctl): the kernel runs VDPBF16PS")
    else:
        assert not bf16_matmul_cpu.uses_tiles(library)
    assert library.bf16_matmul_widened() == (variant in ("avx2", "avx512") or (
        variant == "native" and "avx2" in flags and "avx512_bf16" not in flags))
    g = torch.Generator().manual_seed(5)
    for rows in (1, 5, 14, 16, 17, 33, 70):
        for inputs in (320, 336):
            x, weight = torch.randn(rows, inputs, generator=g).bfloat16(), torch.randn(40, inputs, generator=g).bfloat16()
            assert_matches(x, weight, torch.randn(40, generator=g))


@built
@pytest.mark.bit_exact("cpu")
@pytest.mark.parametrize("variant", ["native", "avx2"])
def test_a_row_sums_in_one_order_at_every_row_count(variant, monkeypatch):
    """`deterministic` packs bf16 layers in pairs because a row's product is the same bits
    alone or among any number of rows (oneDNN's is not): on AMX's tiles, at their edges (16 and
    32 rows a block, 256 a pass) and past them, on the VDPBF16PS path (336 inputs), and with the
    weights widened to float32 (AVX2: 4 rows a block); every row at its place, since a request's
    rows move as others join a step."""
    if variant != "native":
        library = bf16_matmul_cpu.LIBRARY.load(march=march_for(variant))
        monkeypatch.setattr(bf16_matmul_cpu.LIBRARY, "get", lambda: library)
    g = torch.Generator().manual_seed(11)
    for inputs in (576, 336):
        weight = pack_pairs(torch.randn(1000, inputs, generator=g).bfloat16())
        x = torch.randn(300, inputs, generator=g).bfloat16()
        alone = torch.cat([pair_matmul(x[i:i + 1].contiguous(), weight) for i in range(300)])
        for start in (0, 3):
            for rows in (2, 15, 16, 17, 32, 33, 257, 297):
                got = pair_matmul(x[start:start + rows].contiguous(), weight)
                assert torch.equal(got, alone[start:start + rows]), (inputs, start, rows)


@built
def test_a_large_output_streams_past_the_cache_with_the_same_result():
    """Outputs over a megabyte (an LM head's logits at many rows) are stored around the cache on
    AMX's path: the same bits as stored through it (the first 40 rows' outputs are under it)."""
    g = torch.Generator().manual_seed(12)
    weight = pack_pairs(torch.randn(8192, 128, generator=g).bfloat16())
    x = torch.randn(80, 128, generator=g).bfloat16()
    assert torch.equal(pair_matmul(x, weight)[:40], pair_matmul(x[:40].contiguous(), weight))


@built
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_large_weight_splits_over_threads_with_the_same_result(rows):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    weight = pack_pairs(torch.randn(3000, 576, generator=g).bfloat16())
    assert same_on_one_thread(lambda: pair_matmul(x, weight))


@built
def test_declines_what_it_does_not_compute():
    weight = pack_pairs(torch.randn(16, 64).bfloat16())
    assert pair_matmul(torch.randn(2, 64), weight) is None  # float32 rows
    assert pair_matmul(torch.randn(64, 2).bfloat16().T, weight) is None  # not contiguous
    assert pair_matmul(torch.randn(2, 32).bfloat16(), weight) is None  # the wrong number of inputs
    assert pair_matmul(torch.randn(0, 64).bfloat16(), weight) is None  # no rows
