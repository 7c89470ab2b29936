"""Our GEMMs beside the vendor's at Llama-3-8B's linear shapes, in one run: a section of benchmarks/gpu.py.

Per linear of Llama-3-8B (qkv, o, gate_up, down, lm_head) and M tokens (1 to 256; --quick 1, 4, 16,
64, 256), bf16 activations:

  bf16 (cuBLAS)             our bf16 path, F.linear
  fp8 ours                  `fp8_matmul_triton` in its default mode with its own timed choice of tiles
                            (the row names the choice; in "fp8" mode torch._scaled_mm is one of its
                            candidates, so "ours" may be the vendor kernel plus our quantization)
  fp8 torch._scaled_mm      the vendor's FP8 GEMM with row-wise scales on activations quantized
                            beforehand (the GEMM alone, where ours includes its per-token quantization);
                            where it refuses M rows it runs M rounded up to 16, and says so
  int4 ours                 `w4a16_matmul_triton`, groups of 128, its own timed choice of tiles
  int4 tinygemm             torch's `aten._weight_int4pack_mm` on the same codes, scales and offsets
                            repacked (`_convert_weight_to_int4pack`, inner_k_tiles 8, bf16
                            scales_and_zeros [K / G, N, 2], W = (q - 8) * scale + zero)

Per row: time (median of triton.testing.do_bench with the L2 flushed between runs: kernels.py's
timer), the weight's bytes over that time and its share of the copy bandwidth gpu.py measured in
the same run, and for ours the vendor's time over ours (>= 1: ours at least as fast). A vendor
row also gives how far its output is from ours (relative Frobenius norm; a large one would mean the
repacking above is wrong, not that the timing is). Each weight is made once per shape and kind.
A kind that fails leaves its row with the error and the grid goes on; past `seconds` the remaining
rows say they were not measured.

On CPU (the dry run): one tiny shape, M 1 and 16, our kernels through the Triton interpreter
(TRITON_INTERPRET=1 set before triton is imported: gpu.py does it for --device cpu), torch._scaled_mm
on torch's CPU kernel and tinygemm absent (a CUDA op); the numbers are meaningless, the plumbing is
the GPU's.

    python benchmarks/kernel_table.py [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import HEAD_DIM, HIDDEN, INTERMEDIATE, N_HEADS, N_KV_HEADS, make_timer  # noqa: E402
from model_shapes import SHAPES as MODEL_SHAPES  # noqa: E402

SHAPES = {  # name -> (N = out_features, K = in_features) of Llama-3-8B's linears
    "qkv": ((N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
    "lm_head": (MODEL_SHAPES["llama-3-8b"]["vocab_size"], HIDDEN),
}
CPU_SHAPES = {"tiny": (256, 256)}
M_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256)
M_QUICK = (1, 4, 16, 64, 256)
M_CPU = (1, 16)
GROUP = 128
INNER_K_TILES = 8
REP_MS = 5
"""do_bench's repetition time per measurement: the full grid's 225 measurements in ~10 s of an H100."""
TARGET_M = 16
"""The target compares ours with the vendor at M = 1 to this (decode sizes)."""

BF16, FP8, SCALED_MM, INT4, TINYGEMM = ("bf16 (cuBLAS)", "fp8 ours (Triton)", "fp8 torch._scaled_mm (row-wise)",
                                        "int4 ours (Triton, g128)", "int4 tinygemm (torch)")
KINDS = (BF16, FP8, SCALED_MM, INT4, TINYGEMM)
VENDOR_OF = {FP8: SCALED_MM, INT4: TINYGEMM}
FAMILY = {BF16: "bf16", FP8: "fp8", SCALED_MM: "fp8", INT4: "int4", TINYGEMM: "int4"}


@dataclass
class Operands:
    """One shape's weights in every kind's form, made once; `absent`: why a vendor kind cannot run."""

    w: torch.Tensor
    w8: object = None
    w4: object = None
    tinygemm: tuple | None = None
    absent: dict = field(default_factory=dict)
    weight_bytes: dict = field(default_factory=dict)


def make_operands(n: int, k: int, device: torch.device) -> Operands:
    from pagedserve.kernels.fp8 import quantize_fp8
    from pagedserve.kernels.int4 import quantize_int4

    gen = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    ops = Operands(w, quantize_fp8(w), quantize_int4(w, GROUP))
    ops.weight_bytes = {BF16: w.nbytes, FP8: ops.w8.nbytes, SCALED_MM: ops.w8.nbytes, INT4: ops.w4.nbytes}
    if not hasattr(torch, "_scaled_mm"):
        ops.absent[SCALED_MM] = f"absent: torch {torch.__version__} has no torch._scaled_mm"
    elif device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        ops.absent[SCALED_MM] = "absent: needs FP8 tensor cores (sm89+)"
    if device.type != "cuda":  # torch's CPU build has _scaled_mm (its own kernel), the int4 op only for CUDA
        ops.absent[TINYGEMM] = "absent on cpu (a CUDA kernel; the CPU's _weight_int4pack_mm_for_cpu packs otherwise)"
        return ops
    try:
        ops.tinygemm = tinygemm_weight(ops.w4)
        ops.weight_bytes[TINYGEMM] = sum(t.nbytes for t in ops.tinygemm)
    except Exception as error:  # noqa: BLE001 - an op missing or refusing the shape: the row says why
        ops.absent[TINYGEMM] = f"absent: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return ops


def tinygemm_weight(w4) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales_and_zeros) for `aten._weight_int4pack_mm` holding the same weight as our
    Int4Weight: codes as uint8 [N, K / 2] (even k in the high nibble, as torch's tests pack them) through
    `_convert_weight_to_int4pack`, and bf16 [K / G, N, 2] of (scale, zero) with zero = offset + 8 * scale,
    since tinygemm dequantizes (q - 8) * scale + zero where we do q * scale + offset."""
    from pagedserve.kernels.int4 import unpack_int4

    codes = unpack_int4(w4.qweight).t().contiguous()  # [N, K], 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack(((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous(),
                                                        INNER_K_TILES)
    scales = w4.scales.float()
    zeros = w4.offsets.float() + 8 * scales
    return packed, torch.stack([scales, zeros], dim=2).to(torch.bfloat16).contiguous()


def describe(config) -> str:
    """A timed choice of kernels/triton/gemm.py in a few words."""
    if config.block_m == 0:
        return "torch._scaled_mm"
    if config.variant == "dequant":
        return "dequant + cuBLAS"
    variant = f" {config.variant}" if config.variant else ""
    whole = " whole-K" if config.split_k == 1 else ""  # None: split-K as the heuristic chooses
    return f"{config.block_m}x{config.block_n}x{config.block_k}{variant}{whole}"


def timed_choice_of(call) -> str | None:
    """Run `call` once (it times its candidates on the first call of a shape and M bucket) and name the
    configuration it chose; None where nothing was timed (the interpreter takes its one tile)."""
    from pagedserve.kernels.triton import gemm

    tuned = getattr(gemm, "_TUNED", {})
    before = set(tuned)
    call()
    new = [tuned[key] for key in tuned if key not in before]
    return describe(new[-1]) if new else None


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return round(((a - b).norm() / b.norm().clamp(min=1e-30)).item(), 4)


def _measure(ops: Operands, x: torch.Tensor, timer, device: torch.device) -> dict[str, dict]:
    """{kind: partial row} for one (shape, M): us, config, note, diff_vs_ours."""
    from pagedserve.kernels.fp8 import quantize_per_token_fp8
    from pagedserve.kernels.triton.fp8 import _scaled_mm, fp8_matmul_triton
    from pagedserve.kernels.triton.int4 import w4a16_matmul_triton

    m = x.shape[0]
    out: dict[str, dict] = {}
    results: dict[str, torch.Tensor] = {}

    def run(kind: str, call, tuned: bool = False, note: str | None = None) -> None:
        try:
            config = timed_choice_of(call) if tuned else None
            seconds = timer(call)
            results[kind] = call()
            out[kind] = dict(us=round(seconds * 1e6, 2), config=config, note=note)
        except Exception as error:  # noqa: BLE001 - one kind failing must not end the grid
            out[kind] = dict(us=None, config=None, note=f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}")

    run(BF16, lambda: F.linear(x, ops.w))
    run(FP8, lambda: fp8_matmul_triton(x, ops.w8), tuned=True)
    run(INT4, lambda: w4a16_matmul_triton(x, ops.w4), tuned=True)
    if SCALED_MM in ops.absent:
        out[SCALED_MM] = dict(us=None, config=None, note=ops.absent[SCALED_MM])
    else:
        rows = -(-m // 16) * 16
        xq, x_scale = quantize_per_token_fp8(x)
        staged = torch.empty(m, ops.w.shape[0], dtype=x.dtype, device=device)
        run(SCALED_MM, lambda: _scaled_mm(xq, x_scale, ops.w8, None, staged))
        if out[SCALED_MM]["us"] is None and rows != m:  # row-wise scaling wants M % 16 == 0 on some builds
            why = out[SCALED_MM]["note"]
            xq, x_scale = quantize_per_token_fp8(F.pad(x, (0, 0, 0, rows - m)))
            run(SCALED_MM, lambda: _scaled_mm(xq, x_scale, ops.w8, None, staged)[:m],
                note=f"M padded to {rows} rows (unpadded {why})")
    if TINYGEMM in ops.absent:
        out[TINYGEMM] = dict(us=None, config=None, note=ops.absent[TINYGEMM])
    else:
        packed, scales_and_zeros = ops.tinygemm
        run(TINYGEMM, lambda: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales_and_zeros))
    for ours, vendor in VENDOR_OF.items():
        if ours in results and vendor in results:
            out[vendor]["diff_vs_ours"] = rel_diff(results[vendor], results[ours])
    return out


def _row(shape: str, n: int, k: int, m: int, kind: str, weight_bytes: int | None, copy_gb_s: float | None,
         measured: dict) -> dict:
    us = measured.get("us")
    gb_s = float(f"{weight_bytes / us / 1e3:.4g}") if us and weight_bytes else None
    return dict(shape=shape, n=n, k=k, m=m, kind=kind, family=FAMILY[kind], vendor=kind in VENDOR_OF.values(), us=us,
                gb_s=gb_s, copy_share=float(f"{gb_s / copy_gb_s:.3g}") if gb_s and copy_gb_s else None,
                weight_bytes=weight_bytes, vendor_over_ours=None, config=measured.get("config"),
                note=measured.get("note"), diff_vs_ours=measured.get("diff_vs_ours"))


def kernel_rows(device: str, copy_gb_s: float | None = None, quick: bool = False, seconds: float = 90.0,
                progress=print) -> list[dict]:
    """One row per (shape, M, kind), see the module docstring; `copy_gb_s`: the run's copy bandwidth."""
    dev = torch.device(device)
    shapes, ms = (SHAPES, M_QUICK if quick else M_FULL) if dev.type == "cuda" else (CPU_SHAPES, M_CPU)
    timer = make_timer(dev, REP_MS)
    started = time.perf_counter()
    rows: list[dict] = []
    for shape, (n, k) in shapes.items():
        ops = None
        for m in ms:
            if time.perf_counter() - started > seconds:
                late = dict(note=f"not measured: past the section's {seconds:.0f} s")
                rows += [_row(shape, n, k, m, kind, None, copy_gb_s, late) for kind in KINDS]
                continue
            if ops is None:
                ops = make_operands(n, k, dev)
            x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).to(torch.bfloat16)
            measured = _measure(ops, x, timer, dev)
            found = {kind: _row(shape, n, k, m, kind, ops.weight_bytes.get(kind), copy_gb_s, measured[kind])
                     for kind in KINDS}
            for ours, vendor in VENDOR_OF.items():
                if found[ours]["us"] and found[vendor]["us"]:
                    found[ours]["vendor_over_ours"] = round(found[vendor]["us"] / found[ours]["us"], 3)
            rows += found.values()
        if ops is not None:
            progress(f"kernels: {shape} ({n} x {k}) done at {time.perf_counter() - started:.0f} s")
        del ops
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def slowest_vs_vendor(rows: list[dict] | None) -> float | None:
    """Our fp8 and int4 GEMMs' lowest vendor-time-over-ours at M <= TARGET_M over every 8B shape; None
    unless every one of them was measured beside its vendor kernel."""
    ours = [r for r in rows or () if r["shape"] in SHAPES and r["kind"] in VENDOR_OF and r["m"] <= TARGET_M]
    wanted = {(shape, kind) for shape in SHAPES for kind in VENDOR_OF}
    if not ours or {(r["shape"], r["kind"]) for r in ours} != wanted or any(r["vendor_over_ours"] is None for r in ours):
        return None
    return min(r["vendor_over_ours"] for r in ours)


def _cell(row: dict) -> str:
    if row["us"] is None:
        return "-"
    gb_s = row["gb_s"] or 0
    share = "" if row["copy_share"] is None else f" · {row['copy_share']:.0%}"
    return f"{row['us']:,.1f} · {gb_s:,.{0 if gb_s >= 10 else 2}f}{share}"


def markdown(rows: list[dict]) -> str:
    by_key = {(r["shape"], r["m"], r["kind"]): r for r in rows}
    ratio = lambda r: "-" if r["vendor_over_ours"] is None else f"{r['vendor_over_ours']:.2f}x"  # noqa: E731
    cpu = not any(r["shape"] in SHAPES for r in rows)
    lines = ["Linear layers of Llama-3-8B, bf16 activations; a cell: µs · weight GB/s · share of the copy bandwidth; "
             "'vs vendor': the vendor kernel's time over ours (>= 1.00x: ours at least as fast)"
             + (" (CPU dry run: our kernels through the Triton interpreter, numbers meaningless)" if cpu else "") + ".", "",
             f"| shape (N x K) | M | {BF16} | {FP8} | {SCALED_MM} | fp8 vs vendor | {INT4} | {TINYGEMM} | int4 vs vendor "
             "| our tiles (fp8 / int4) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        row = {kind: by_key[(shape, m, kind)] for kind in KINDS}
        first = row[BF16]
        tiles = " / ".join(row[kind]["config"] or "-" for kind in VENDOR_OF)
        lines.append(f"| {shape} ({first['n']} x {first['k']}) | {m} | {_cell(row[BF16])} | {_cell(row[FP8])} "
                     f"| {_cell(row[SCALED_MM])} | {ratio(row[FP8])} | {_cell(row[INT4])} | {_cell(row[TINYGEMM])} "
                     f"| {ratio(row[INT4])} | {tiles} |")
    notes = dict.fromkeys(f"{r['kind']}: {r['note']}" for r in rows if r["note"])
    for kind in VENDOR_OF.values():
        diffs = [r["diff_vs_ours"] for r in rows if r["kind"] == kind and r.get("diff_vs_ours") is not None]
        if diffs:
            worse = " (more than rounding: its operands may be prepared wrong; its times stand)" if max(diffs) > 0.05 else ""
            notes[f"{kind}: output against ours within {max(diffs):.2g} (relative){worse}"] = None
    return "\n".join(lines + [""] + [f"- {note}" for note in notes] if notes else lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    print(markdown(kernel_rows(args.device, quick=args.quick)))
