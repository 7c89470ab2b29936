"""Matmuls on CPU: the bundled model's linear layers multiplied by 1-128 rows (a single
stream's decode to a batch's step and a prefill chunk), each way the engine can
(backend/cpu/linear_methods.py), on its real weights, in float32 or (--dtype bfloat16) bf16.

float32 ways: the C matmul over the weights' exact GGUF blocks (kernels/cpu/block_matmul.py:
Q4_1 decoder layers, the Q8_0 embedding as LM head; a streaming loop up to 8 rows, a tiled GEMM
beyond), the C GEMV over the plain float32 weight (up to 4 rows), oneDNN's packed float32
weight, and MKL over a transposed copy. bf16 ways: the C matmul over the weight in pairs
(kernels/cpu/bf16_matmul.py: AMX tiles where the CPU has them, else VDPBF16PS, else its plain
loop; the column names which) and oneDNN's packed bf16 weight (AMX or AVX512-BF16 inside).
One pass = every decoder linear (qkv, o, gate_up, down of each layer) and, separately, the LM
head; the ways alternate pass by pass for --rounds rounds and each keeps its fastest (weights
streamed from memory, as in a step). Cells: ms per pass (GB/s of the weights in the dtype,
however many bytes the way actually reads; GFLOP/s). A row count a way does not take shows "-".

    python benchmarks/cpu_matmul.py [--dtype float32|bfloat16] [--rounds 7] [--rows 1,2,4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import machine  # noqa: E402

from pagedserve.backend.model_files import default_model_path  # noqa: E402
from pagedserve.backend.model_loader import load_model  # noqa: E402
from pagedserve.backend.cpu.linear_methods import PACK_ROWS_HINT  # noqa: E402
from pagedserve.backend.models.linear import Linear  # noqa: E402
from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu, block_matmul as block_matmul_cpu  # noqa: E402
from pagedserve.kernels.cpu import gemv as gemv_cpu  # noqa: E402

Multiply = Callable[[torch.Tensor], object]


@dataclass
class Weight:
    """One weight, laid out every way: name -> (most rows the way takes, x -> x @ weight.T)."""

    in_features: int
    ways: dict[str, tuple[int, Multiply]]


def ways_for(weight: torch.Tensor) -> dict[str, tuple[int, Multiply]]:
    """Each way to multiply rows by this weight: (most rows it takes, x -> x @ weight.T)."""
    plain = weight.detach().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_ROWS_HINT)
    if plain.dtype == torch.bfloat16:
        pairs = bf16_matmul_cpu.pack_pairs(plain)
        return {f"C pairs ({bf16_matmul_cpu.instructions()})": (1 << 30, lambda x: bf16_matmul_cpu.pair_matmul(x, pairs)),
                "oneDNN packed": (1 << 30, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))}
    transposed = plain.t().contiguous()
    blocks = block_matmul_cpu.as_blocks(plain)
    ways = {
        "C GEMV, plain": (gemv_cpu.GEMV_MAX_ROWS, lambda x: gemv_cpu.gemv(x, plain)),
        "oneDNN packed": (1 << 30, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
        "MKL transposed": (1 << 30, lambda x: torch.matmul(x, transposed)),
    }
    if blocks is not None:
        ways = {f"C, {blocks.kind} blocks": (1 << 30, lambda x: block_matmul_cpu.block_matmul(x, blocks)), **ways}
    return ways


def time_passes(weights: list[Weight], rows: int, rounds: int, dtype: torch.dtype) -> dict[str, float | None]:
    """Fastest seconds per pass over `weights` for each way that takes `rows` (None if it does not)."""
    names = list(weights[0].ways)
    inputs = [torch.randn(rows, weight.in_features, dtype=dtype) for weight in weights]
    best: dict[str, float | None] = {name: float("inf") for name in names}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name in names if round_ % 2 else reversed(names):
            if weights[0].ways[name][0] < rows:
                best[name] = None
                continue
            started = time.perf_counter()
            for weight, x in zip(weights, inputs):
                weight.ways[name][1](x)
            if round_:
                best[name] = min(best[name], time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> dict[str, dict[int, dict[str, float | None]]]:
    """Print the tables; returns {group: {rows: {way: fastest seconds per pass, or None}}}."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if gemv_cpu.LIBRARY.get() is None or block_matmul_cpu.LIBRARY.get() is None or bf16_matmul_cpu.LIBRARY.get() is None:
        sys.exit("the C kernels are not built here (no C compiler: set CC or install gcc)")
    print(machine(), flush=True)
    print(f"loading the bundled model in {args.dtype} and laying each weight out every way ...", flush=True)
    model = load_model(default_model_path(), dtype, torch.device("cpu")).model
    groups: dict[str, list[Weight]] = {"decoder linears": [], "LM head": []}
    results: dict[str, dict[int, dict[str, float | None]]] = {}
    with torch.inference_mode():
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                groups["LM head" if name == "lm_head" else "decoder linears"].append(
                    Weight(module.in_features, ways_for(module.weight)))
        params_of = {group: sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, Linear)
                                and (n == "lm_head") == (group == "LM head")) for group in groups}
        bytes_of = {group: dtype.itemsize * params for group, params in params_of.items()}
        for group, weights in groups.items():
            names = list(weights[0].ways)
            print(f"\n{group}: {len(weights)} weights, {bytes_of[group] / 1e6:.0f} MB in {args.dtype}; "
                  f"ms per pass (GB/s of {args.dtype} weights; GFLOP/s)\n")
            print("| rows | " + " | ".join(names) + " |")
            print("|---:|" + "---:|" * len(names))
            for rows in (int(r) for r in args.rows.split(",")):
                best = results.setdefault(group, {})[rows] = time_passes(weights, rows, args.rounds, dtype)
                cells = [("-" if best[n] is None else f"{best[n] * 1e3:.2f} ({bytes_of[group] / best[n] / 1e9:.0f}; "
                                                       f"{2 * rows * params_of[group] / best[n] / 1e9:.0f})") for n in names]
                print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    return results


if __name__ == "__main__":
    main()
