"""The C matmul over exact GGUF blocks (kernels/cpu/block_matmul.py) against torch's matmul of
the float32 weight the blocks rebuild.

The weights are the same float32 values, so only the order of the additions differs: within
1e-5 relative to the sum of |x_i w_i| of each output, at every row count (the few-row loop and
the tiled GEMM), for shapes that are not whole tiles (outputs not a multiple of 16, inputs in
several chunks, rows in several passes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.kernels.cpu import block_matmul as block_matmul_cpu
from pagedserve.kernels.cpu.block_matmul import as_blocks, block_matmul, grid_weight
from .instruction_sets import march_for
from .threads import same_on_one_thread

built = pytest.mark.skipif(block_matmul_cpu.LIBRARY.get() is None, reason="the C matmul is not built here (no C compiler)")


def test_q8_parts_rebuild_the_weight_bit_for_bit():
    weight = grid_weight("q8_0", 64, 96, seed=2)
    parts = as_blocks(weight)
    assert parts is not None and parts.kind == "q8_0" and parts.codes.numel() == 64 * 96
    # output 16 g + n's block b is codes[g, b, :, n]: 16 outputs' bytes of one input lie together
    q = parts.codes.view(torch.int8).float().permute(0, 3, 1, 2).reshape(64, 3, 32)
    scales = parts.scales.transpose(1, 2).reshape(64, 3)
    assert torch.equal(scales[..., None] * q, weight.view(64, 3, 32))
    assert torch.equal(parts.dequantize(), weight)
    assert as_blocks(weight * 1.0001) is None


def test_q4_parts_rebuild_the_weight_bit_for_bit_or_are_refused():
    weight = grid_weight("q4_1", 96, 128, seed=1)
    parts = as_blocks(weight)
    assert parts is not None and parts.kind == "q4_1" and parts.shape == (96, 128) and parts.codes.numel() == 96 * 64
    codes = parts.codes.permute(0, 3, 1, 2).reshape(96, 4, 16)
    q = torch.cat([(codes & 15).float(), (codes >> 4).float()], dim=-1)
    scales, offsets = (t.transpose(1, 2).reshape(96, 4) for t in (parts.scales, parts.offsets))
    assert torch.equal(scales[..., None] * q + offsets[..., None], weight.view(96, 4, 32))
    assert torch.equal(parts.dequantize(), weight)
    assert as_blocks(weight + 1e-6) is None  # off the grid: refused, never approximated
    assert as_blocks(torch.randn(96, 128)) is None
    assert as_blocks(weight[:, :100].contiguous()) is None  # not whole blocks


def test_outputs_are_padded_to_whole_groups_with_zero_weights():
    weight = grid_weight("q4_1", 21, 64, seed=3)
    parts = as_blocks(weight)
    assert parts.shape == (21, 64) and parts.scales.shape == (2, 2, 16)  # 21 outputs in two groups of 16
    assert torch.equal(parts.dequantize(), weight)
    assert not parts.scales[1, :, 5:].any() and not parts.codes[1, ..., 5:].any()


def assert_matches_float32_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    out = block_matmul(x, as_blocks(weight), bias)
    reference = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == torch.float32
    assert ((out.double() - reference).abs() <= 1e-5 * scale).all()


@built
@pytest.mark.parametrize("rows", [*range(1, block_matmul_cpu.GEMV_ROWS + 3), 17, 64, 131])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_block_weights_multiply_like_their_float32_values(rows, bias, kind):
    """Up to GEMV_ROWS the few-row loop, beyond it the GEMM (131 rows: a pass of 128 and one of 3)."""
    weight = grid_weight(kind, 200, 576, seed=rows)
    assert as_blocks(weight).kind == kind
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    assert_matches_float32_weight(x, weight, torch.randn(200, generator=g) if bias else None)


@built
@pytest.mark.parametrize("in_features, out_features", [(1536, 576), (1600, 7), (32, 13), (800, 1), (64, 49152 // 64)])
@pytest.mark.parametrize("rows", [3, 9, 40, 100])
def test_shapes_that_are_not_whole_tiles(in_features, out_features, rows):
    """Outputs not a multiple of 16 (a group) or 48 (the GEMM's panel), inputs in one or several
    chunks of its scratch (160 inputs with AVX-512, 256 with AVX2; 1,600 = 10 even ones), a
    single block, a single output; 100 rows of 1,536 or 1,600 inputs: passes of fewer rows than
    of short inputs (their rows kept within L2), the last one partial."""
    g = torch.Generator().manual_seed(in_features + out_features + rows)
    weight = grid_weight("q4_1", out_features, in_features, seed=rows)
    assert_matches_float32_weight(torch.randn(rows, in_features, generator=g), weight, torch.randn(out_features, generator=g))


@built
@pytest.mark.parametrize("variant", ["x86-64", "avx2", "avx512", "native"])
def test_every_instruction_set_the_cpu_runs_computes_the_same_products(variant, monkeypatch):
    """A machine builds only its own -march=native code; the others are built here on purpose
    (natively where the CPU runs them, AVX-512 emulated by SIMDe elsewhere), so each vector
    width's tiles (and their leftover rows) are checked on one CPU."""
    library = block_matmul_cpu.LIBRARY.load(march="native" if variant == "native" else march_for(variant))
    monkeypatch.setattr(block_matmul_cpu.LIBRARY, "get", lambda: library)
    g = torch.Generator().manual_seed(11)
    for rows in (1, 5, 9, 14, 33, 70):
        for kind in block_matmul_cpu.BLOCK_KINDS:
            weight = grid_weight(kind, 50, 1600, seed=rows)
            assert as_blocks(weight).kind == kind
            assert_matches_float32_weight(torch.randn(rows, 1600, generator=g), weight, torch.randn(50, generator=g))


@built
@pytest.mark.bit_exact("cpu")
@pytest.mark.parametrize("variant", ["x86-64", "avx2", "avx512", "native"])
def test_batch_invariant_blocks_give_a_row_the_same_bits_at_every_row_count(variant, monkeypatch):
    """`batch_invariant` (the engine's `deterministic`): each row's outputs bit for bit the same
    whether it is multiplied alone, beside a few rows (the few-row loop) or many (the GEMM),
    inputs in several chunks, a bias added; per vector width, as above; and at another place among
    them (a request's rows move as others join a step)."""
    library = block_matmul_cpu.LIBRARY.load(march="native" if variant == "native" else march_for(variant))
    monkeypatch.setattr(block_matmul_cpu.LIBRARY, "get", lambda: library)
    g = torch.Generator().manual_seed(5)
    for kind in block_matmul_cpu.BLOCK_KINDS:
        weight = dataclasses.replace(as_blocks(grid_weight(kind, 40, 1600, seed=3)), batch_invariant=True)
        x, bias = torch.randn(40, 1600, generator=g), torch.randn(40, generator=g)
        every = block_matmul(x, weight, bias)
        for start in (0, 1, 5):
            for rows in (1, 2, 3, 8, 9, 17):
                got = block_matmul(x[start:start + rows].contiguous(), weight, bias)
                assert torch.equal(got, every[start:start + rows]), (kind, start, rows)


@built
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_large_weight_splits_over_threads_with_the_same_result(rows):
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(rows, 576, generator=g), as_blocks(grid_weight("q8_0", 3000, 576, seed=7))
    assert same_on_one_thread(lambda: block_matmul(x, weight))


@built
def test_declines_what_it_does_not_compute():
    weight = as_blocks(grid_weight("q4_1", 8, 64, seed=0))
    assert block_matmul(torch.randn(2, 64).bfloat16(), weight) is None  # float32 only
    assert block_matmul(torch.randn(64, 2).T, weight) is None  # not contiguous
    assert block_matmul(torch.randn(1, 32), weight) is None  # sizes disagree
    assert block_matmul(torch.randn(1, 64), weight, torch.randn(7)) is None  # bias of another size
    assert block_matmul(torch.randn(0, 64), weight) is None  # no rows
