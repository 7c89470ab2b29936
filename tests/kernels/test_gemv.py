"""The decode-sized GEMV kernels for quantized weights (kernels/triton/gemv.py): W4A16 (`Int4Weight`)
and W8A16 (`Fp8Weight` e4m3, `Int8Weight`) at M = 1..4, through the launchers with a "gemv" config
(compiled on CUDA, through the Triton interpreter on CPU), against the torch references computed in
fp32 (`w4a16_matmul_ref`, `fp8_matmul_ref` of fp32 activations).

Stated bound, per output element y of dtype D (bf16 / fp16), reference r (fp32), checked below:

    |y - r| <= 2 ulp_D(r) + 4 sqrt(K) 2^-24 mag,   mag = sum_k |x_k W_nk| + |b_n|

The kernel accumulates in fp32 and rounds once, to D, at the end, so its result is its fp32 sum
rounded: within 1 ulp of D (the interpreter truncates fp32 -> bf16 rather than rounding to
nearest; a GPU, and fp16 anywhere, round within half an ulp), 2 ulp leaving room for a sum at a
binade's edge. The second term covers the two sides' fp32 sums of K products taken in different
orders: their rounding errors, of random signs, grow like sqrt(K) 2^-24 mag (the worst case,
K 2^-24 mag, is several ulp of fp16 in the INT4 cases here and would hide real errors), and
4 sqrt(K) keeps a margin of several standard deviations. For INT4 the products are s q x and b x (mag sums their
magnitudes: both sides factor the group offset out, and groups far from 0 make the two terms
cancel). Outside such cancellations the first term dominates (2 ulp of bf16 is 2^-7 relative).
Measured here: at most 1 ulp (bf16) and 0.5 ulp (fp16) on all but near-cancelling outputs, and
at most half the bound anywhere.

Determinism: two runs at one config give the same bits, also when the programs run in reverse
order (the interpreter only: the last program to arrive at an output tile is then slice 0 rather
than slice S-1, and it still sums the partials in slice order; on data whose slices nearly cancel,
so that the order of the four partial sums shows in fp16's last bits: a sum in arrival order fails
here); another split count moves a result by at most fp32 reassociation (the bound above; between
the two roundings, 1 ulp plus the fp32 term). The split-K counters are back at zero after every
launch.
"""

from __future__ import annotations

import pytest
import torch

from .gemm_checks import DEVICE, HAS_CUDA, needs_triton  # first: sets TRITON_INTERPRET=1 without CUDA
from pagedserve.kernels.fp8 import (
    Fp8Weight,
    Int8Weight,
    dequantize_fp8,
    fp8_from_blocks,
    fp8_matmul_ref,
    quantize_fp8,
    quantize_fp8_blocks,
)
from pagedserve.kernels.int4 import quantize_int4, unpack_int4, w4a16_matmul_ref
from pagedserve.kernels.numerics import FP8_DTYPE

pytestmark = needs_triton


def _modules():
    from pagedserve.kernels.triton import fp8 as ft, gemv as gt, int4 as it

    return gt, it, ft


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unit in the last place of dtype at |v| (fp32 v), subnormals included."""
    fi = torch.finfo(dtype)
    return fi.eps * torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=fi.tiny))))


def _check(y: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, k: int, what: str) -> None:
    """y (bf16 / fp16) against the fp32 reference, with the bound of the module docstring."""
    y32, ref, mag = y.float().cpu(), ref.float().cpu(), mag.float().cpu()
    bound = 2 * _ulp(ref, y.dtype) + 4 * k**0.5 * 2.0**-24 * mag
    err = (y32 - ref).abs()
    assert bool((err <= bound).all()), f"{what}: max error {float((err / bound).max()):.2f} x the bound"


def _int4_magnitudes(x: torch.Tensor, w, bias) -> torch.Tensor:
    """sum_k |x_k| (|s q| + |b|) (+ |bias|) in the packed-row order (perm applied to x)."""
    n, k = w.shape
    g = w.group_size
    q = unpack_int4(w.qweight.cpu()).float().view(k // g, g, n)
    terms = (q * w.scales.cpu().float().abs().unsqueeze(1) + w.offsets.cpu().float().abs().unsqueeze(1)).view(k, n)
    xa = x.float().cpu().abs()
    if w.perm is not None:
        xa = xa.index_select(1, w.perm.cpu())
    return xa @ terms + (0 if bias is None else bias.float().cpu().abs())


def _counters_zero() -> bool:
    gt, _, _ = _modules()
    return all(int(c.abs().sum()) == 0 for c in gt._COUNTERS.values())


# ----------------------------------------------------------------- W4A16

W4_CASES = [
    # n, k, group, block_n, block_k, split, bias, perm, scale dtype, activations
    (96, 256, 32, 64, 32, 1, True, False, None, torch.bfloat16),  # N = 1.5 tiles, whole K
    (160, 512, 128, 128, 64, 3, False, True, torch.bfloat16, torch.float16),  # act-order, 3 slices
    (96, 256, 32, 512, 32, 4, True, True, torch.float16, torch.bfloat16),  # a launcher tile, 4 slices
]


def _int4_case(seed: int, n: int, k: int, group: int, bias: bool, perm: bool, scale_dtype, dtype, m: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[::7] += 0.3  # groups far from 0: offsets large against the scale (the s.q and b.x terms cancel)
    qw = quantize_int4(w, group, scale_dtype=scale_dtype)
    if perm:
        qw.perm = torch.randperm(k, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return qw, x, b


@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: f"n{c[0]}k{c[1]}g{c[2]}bn{c[3]}bk{c[4]}s{c[5]}")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_w4a16_gemv_matches_reference(m, case):
    gt, it, _ = _modules()
    n, k, group, bn, bk, split, bias, perm, scale_dtype, dtype = case
    qw, x, b = _int4_case(100 + m + n, n, k, group, bias, perm, scale_dtype, dtype, m)
    cfg = it.GemmConfig(gt.gemv_block_m(m), bn, bk, split_k=split, variant=gt.GEMV)
    y = it.w4a16_matmul_triton(x.to(DEVICE), qw.to(DEVICE), None if b is None else b.to(DEVICE), config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = w4a16_matmul_ref(x.float(), qw, None if b is None else b.float())
    _check(y, ref, _int4_magnitudes(x, qw, b), k, f"W4A16 m={m}")
    assert _counters_zero()


# ----------------------------------------------------------------- W8A16

W8_CASES = [
    # kind, n, k, group, block_n, block_k, split, bias, activations, mode, hardware e4m3
    ("fp8", 96, 256, 0, 64, 64, 1, True, torch.bfloat16, "w8a16", True),  # channel scales
    ("fp8", 160, 200, 64, 64, 64, 3, False, torch.float16, "fp8", True),  # blocks of 32 x 64, K = 3.1 tiles, mode fp8
    ("fp8", 96, 256, 128, 128, 128, 2, True, torch.bfloat16, "w8a16", False),  # e4m3 decoded with integer ops (sm_80)
    ("int8", 96, 256, 0, 64, 64, 4, True, torch.float16, "w8a16", True),
    ("int8", 160, 256, 64, 128, 64, 2, False, torch.bfloat16, "w8a16", True),
]


def _w8_case(seed: int, kind: str, n: int, k: int, group: int, bias: bool, dtype, m: int):
    gen = torch.Generator().manual_seed(seed)
    if kind == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand((n, -(-k // group)) if group else (n,), generator=gen) * 1e-3
        w: Fp8Weight = Int8Weight(codes, scale, group)
    else:
        dense = torch.randn(n, k, generator=gen) * 0.05
        w = fp8_from_blocks(*quantize_fp8_blocks(dense, (32, group)), (32, group)) if group else quantize_fp8(dense)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return w, x, b


@pytest.mark.parametrize("case", W8_CASES, ids=lambda c: f"{c[0]}-n{c[1]}k{c[2]}g{c[3]}s{c[6]}-{c[9]}-{'hw' if c[10] else 'sw'}")
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_w8a16_gemv_matches_reference(m, case, monkeypatch):
    gt, _, ft = _modules()
    kind, n, k, group, bn, bk, split, bias, dtype, mode, native = case
    if not native:
        monkeypatch.setattr(ft, "native_fp8", lambda device: False)  # as on an A100
    elif HAS_CUDA and not ft.native_fp8(torch.device("cuda")):
        pytest.skip("hardware e4m3 needs sm_89+")
    w, x, b = _w8_case(200 + m + n, kind, n, k, group, bias, dtype, m)
    cfg = ft.GemmConfig(gt.gemv_block_m(m), bn, bk, split_k=split, variant=gt.GEMV)
    assert not ft.quantizes(cfg, mode)  # 16-bit activations in either mode
    y = ft.fp8_matmul_triton(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), mode=mode, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = fp8_matmul_ref(x.float(), w, None if b is None else b.float())
    mag = x.float().abs() @ dequantize_fp8(w).abs().t() + (0 if b is None else b.float().abs())
    _check(y, ref, mag, k, f"W8A16 {kind} m={m}")
    assert _counters_zero()


@pytest.mark.parametrize("native", [True, False])
def test_w8a16_gemv_decodes_every_code(native):
    """One weight column of every non-NaN e4m3 code (hardware conversion and integer decode), and
    every int8 code, read back exactly by a one-hot activation (fp16 holds every e4m3 value)."""
    gt, _, ft = _modules()
    if native and HAS_CUDA and not ft.native_fp8(torch.device("cuda")):
        pytest.skip("hardware e4m3 needs sm_89+")
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 254 codes
    weight = torch.zeros(254, 16, dtype=torch.uint8)
    weight[:, 0] = codes
    x = torch.zeros(1, 16, dtype=torch.float16)
    x[0, 0] = 1.0
    cfg = ft.GemmConfig(1, 64, 16, split_k=1, variant=gt.GEMV)
    w = Fp8Weight(weight.view(FP8_DTYPE), torch.ones(254)).to(DEVICE)
    y = gt.w8a16_gemv(x.to(DEVICE), w, None, torch.empty(1, 254, dtype=torch.float16, device=DEVICE), cfg, native=native)
    assert torch.equal(y[0].float().cpu(), codes.view(FP8_DTYPE).float())
    ints = torch.zeros(256, 16, dtype=torch.int8)
    ints[:, 0] = torch.arange(-128, 128, dtype=torch.int8)
    w8 = Int8Weight(ints, torch.ones(256)).to(DEVICE)
    y = gt.w8a16_gemv(x.to(DEVICE), w8, None, torch.empty(1, 256, dtype=torch.float16, device=DEVICE), cfg)
    assert torch.equal(y[0].float().cpu(), torch.arange(-128, 128).float())


# ----------------------------------------------------------------- determinism, split-K

@pytest.fixture
def reversed_programs(monkeypatch):
    """Under the interpreter, a function that runs the grid's K slices in reverse order while set
    (programs run one at a time there, so the last to arrive at a tile is otherwise slice S-1)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    plain = builder.set_grid_idx

    def reversed_k(x, y, z):
        plain(x, builder.grid_dim[1] - 1 - y, z)

    def use(on: bool):
        monkeypatch.setattr(builder, "set_grid_idx", reversed_k if on else plain)

    return use


SLICE = 128
"""K columns a slice at split 4 (K = 512, BLOCK_K = 64): the determinism cases' layout."""


def _cancelling(seed: int, n: int, k: int, m: int, dtype):
    """Dense w [n, k] and x [m, k] whose slices 0 and 1 nearly cancel: the same weight columns, x
    negated but for a small difference, so partials of ~1e4 sum to ~1, and a big partial added to a
    small one rounds at its own ulp (~1e-3) where fp16's ulp at the result is ~5e-4: an order that
    followed the programs' arrival would not give the same bits both ways."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05 + 0.2
    w[:, SLICE:2 * SLICE] = w[:, :SLICE]
    x = torch.randn(m, k, generator=gen) * 0.1
    x[:, :SLICE] *= 1e4
    x[:, SLICE:2 * SLICE] = -x[:, :SLICE] + 0.01 * torch.randn(m, SLICE, generator=gen)
    b = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    return w, x.to(dtype), b


def _w4_run(m: int, split, dtype=torch.float16):
    gt, it, _ = _modules()
    w, x, b = _cancelling(7, 160, 4 * SLICE, m, dtype)
    qw = quantize_int4(w, 128)
    cfg = it.GemmConfig(gt.gemv_block_m(m), 64, 64, split_k=split, variant=gt.GEMV)
    y = it.w4a16_matmul_triton(x.to(DEVICE), qw.to(DEVICE), b.to(DEVICE), config=cfg)
    return y, w4a16_matmul_ref(x.float(), qw, b.float()), _int4_magnitudes(x, qw, b)


def _w8_run(m: int, split, dtype=torch.float16):
    gt, _, ft = _modules()
    w, x, b = _cancelling(8, 160, 4 * SLICE, m, dtype)
    w = fp8_from_blocks(*quantize_fp8_blocks(w, (32, 128)), (32, 128))
    cfg = ft.GemmConfig(gt.gemv_block_m(m), 64, 64, split_k=split, variant=gt.GEMV)
    y = ft.fp8_matmul_triton(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), mode="w8a16", config=cfg)
    mag = x.float().abs() @ dequantize_fp8(w).abs().t() + b.float().abs()
    return y, fp8_matmul_ref(x.float(), w, b.float()), mag


@pytest.mark.parametrize("run", [_w4_run, _w8_run], ids=["w4a16", "w8a16"])
def test_split_k_is_deterministic_and_in_slice_order(run, reversed_programs):
    gt, _, _ = _modules()
    m, split = 3, 4
    first, ref, mag = run(m, split)
    again, _, _ = run(m, split)
    assert torch.equal(first, again)  # same bits, run to run
    if gt.gemm.interpreting():
        reversed_programs(True)
        backwards, _, _ = run(m, split)  # slice 0 arrives last now
        reversed_programs(False)
        assert torch.equal(first, backwards)
    assert _counters_zero()
    whole, _, _ = run(m, 1)  # no split: the same products summed in another order
    k = 4 * SLICE
    _check(first, ref, mag, k, "split 4")
    _check(whole, ref, mag, k, "split 1")
    gap = (first.float() - whole.float()).abs().cpu()
    assert bool((gap <= _ulp(ref, first.dtype) + 4 * k**0.5 * 2.0**-24 * mag).all())


def test_grid_rows_past_block_m():
    """More rows than BLOCK_M (never chosen by the launchers, still correct): grid axis 2 tiles M."""
    gt, it, _ = _modules()
    qw, x, b = _int4_case(9, 96, 256, 128, True, False, None, torch.bfloat16, 6)
    cfg = it.GemmConfig(4, 64, 64, split_k=2, variant=gt.GEMV)
    y = it.w4a16_matmul_triton(x.to(DEVICE), qw.to(DEVICE), b.to(DEVICE), config=cfg)
    _check(y, w4a16_matmul_ref(x.float(), qw, b.float()), _int4_magnitudes(x, qw, b), 256, "W4A16 m=6")


# ----------------------------------------------------------------- candidates

def test_gemv_candidates_come_first_at_decode_sizes(monkeypatch):
    """At M <= 4 the launchers' first candidate (the untimed default) is the GEMV, with BLOCK_M
    1, 2 or 4, K tiles inside the group; beyond 4 rows there is none. In FP8 mode it takes the
    activations as they are (no per-token quantization). As on a GPU: the interpreter's own
    single-candidate branch is switched off, as the AOT device model does."""
    gt, it, ft = _modules()
    monkeypatch.setattr(it, "interpreting", lambda: False)
    monkeypatch.setattr(ft, "interpreting", lambda: False)
    for m in (1, 2, 3, 4, 5, 16):
        for group in (32, 128):
            configs = it._candidates(m, 4096, 4096, group)
            gemv = [c for c in configs if c.variant == gt.GEMV]
            if m > gt.MAX_M:
                assert not gemv
                continue
            assert configs[: len(gemv)] == gemv and len(gemv) >= 3
            assert all(c.block_m == gt.gemv_block_m(m) and group % c.block_k == 0 for c in gemv)
        for mode in ("fp8", "w8a16"):
            for group in (0, 128):
                configs = ft._candidates(m, 4096, 4096, mode, group)
                gemv = [c for c in configs if c.variant == gt.GEMV]
                if m > gt.MAX_M:
                    assert not gemv
                    continue
                assert configs[: len(gemv)] == gemv and len(gemv) >= 3
                assert all(c.block_m == gt.gemv_block_m(m) and not ft.quantizes(c, mode) for c in gemv)
                assert not group or all(group % c.block_k == 0 for c in gemv)
