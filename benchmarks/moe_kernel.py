"""The fused MoE kernel (kernels/triton/moe.py) against the torch reference (kernels/moe.py, one pair
of matmuls per expert with tokens) on one layer of real MoE models' experts, random weights in bf16,
random routings, the experts in bf16, in fp8 (e4m3, per-channel scales), in 4-bit (group-wise
scales and offsets) and in MXFP4 (gpt-oss's form): time per call, and for the fused kernel the share of the device's copy
bandwidth that reading the touched experts' weights once would take (decode sizes are bound by
that read).

A section of benchmarks/gpu.py (`moe_rows`); alone: `python benchmarks/moe_kernel.py [--device cpu]`
(on CPU only the reference runs, on tiny shapes: the dry run).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from pagedserve.kernels.moe import ExpertWeights, fused_moe_ref, quantize_experts_fp8, quantize_experts_int4, route


@dataclass(frozen=True)
class MoeLayer:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int


GPU_LAYERS = (MoeLayer("Mixtral-8x7B", 4096, 14336, 8, 2), MoeLayer("Qwen3-30B-A3B", 2048, 768, 128, 8))
CPU_LAYERS = (MoeLayer("tiny", 64, 96, 8, 2),)
TOKENS = (1, 32, 256, 2048)


def _time(function, device: str, repeats: int) -> float:
    """Best of `repeats` calls, in ms (one warm-up first: the Triton compile)."""
    function()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def moe_rows(device: str, copy_gb_s: float | None = None, tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    """One row per (layer, token count); `copy_gb_s`: the device's measured copy bandwidth."""
    layers = GPU_LAYERS if device == "cuda" else CPU_LAYERS
    fused = None
    if device == "cuda":
        from pagedserve.kernels.triton.moe import fused_moe_triton as fused
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for layer in layers:
        w13 = torch.randn(layer.experts, 2 * layer.inter, layer.hidden, device=device, dtype=torch.bfloat16,
                          generator=g) * layer.hidden ** -0.5
        w2 = torch.randn(layer.experts, layer.hidden, layer.inter, device=device, dtype=torch.bfloat16,
                         generator=g) * layer.inter ** -0.5
        bf16 = ExpertWeights(w13, w2)
        for form, quantize in (("bf16", None), ("fp8", quantize_experts_fp8), ("int4", quantize_experts_int4),
                               ("mxfp4", lambda dense: random_mxfp4(dense, g))):
            experts = bf16 if quantize is None else quantize(bf16)
            stored = (experts.w13, experts.w2, experts.w13_scale, experts.w2_scale, experts.w13_offset, experts.w2_offset)
            expert_bytes = sum(t.nbytes for t in stored if t is not None) // layer.experts
            for count in tokens:
                rows.append(_row(layer, form, experts, expert_bytes, count, device, g, fused, copy_gb_s))
            del experts
        del w13, w2, bf16
    return rows


def random_mxfp4(dense: ExpertWeights, g: torch.Generator) -> ExpertWeights:
    """MXFP4 experts of `dense`'s shape (gpt-oss's form; random codes, scales near the dense weights')."""
    def codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e, rows, cols = weight.shape
        device = weight.device
        return (torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, device=device, generator=g),
                torch.randint(118, 122, (e, rows, cols // 32), dtype=torch.uint8, device=device, generator=g))

    (w13, s13), (w2, s2) = codes(dense.w13), codes(dense.w2)
    return ExpertWeights(w13, w2, s13, s2, group_size=32)


def _row(layer: MoeLayer, form: str, experts: ExpertWeights, expert_bytes: int, count: int, device: str,
         g: torch.Generator, fused, copy_gb_s: float | None) -> dict:
    x = torch.randn(count, layer.hidden, device=device, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(count, layer.experts, device=device, generator=g)
    weights, ids = route(logits, layer.top_k, renormalize=True, rounded=False)
    touched = int(torch.unique(ids).numel())
    repeats = 5 if device == "cuda" else 2
    ref_ms = _time(lambda: fused_moe_ref(x, experts, weights, ids), device, repeats)
    row = dict(layer=layer.name, experts=form, tokens=count, experts_touched=touched, ref_ms=round(ref_ms, 3),
               fused_ms=None, speedup=None, bandwidth_share=None)
    if fused is not None:
        fused_ms = _time(lambda: fused(x, experts, weights, ids), device, repeats)
        row.update(fused_ms=round(fused_ms, 3), speedup=round(ref_ms / fused_ms, 2))
        if copy_gb_s:
            read_ms = touched * expert_bytes / (copy_gb_s * 1e9) * 1e3  # as gpu.py's roofline: bytes / copy rate
            row["bandwidth_share"] = round(read_ms / fused_ms, 3)
    return row


def markdown(rows: list[dict]) -> str:
    show = lambda v, f="{}": "-" if v is None else f.format(v)  # noqa: E731
    lines = ["| MoE layer (bf16 activations) | experts | tokens | experts touched | torch reference (ms) | fused Triton (ms) "
             "| speedup | weight read at copy bandwidth / fused time |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['experts']} | {r['tokens']} | {r['experts_touched']} | {r['ref_ms']} | {show(r['fused_ms'])} "
                     f"| {show(r['speedup'], '{}x')} | {show(r['bandwidth_share'], '{:.0%}')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    print(markdown(moe_rows(args.device)))
