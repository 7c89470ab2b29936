"""benchmarks/cpu_matmul.py: every way the engine can multiply the bundled model's linears on
CPU, timed against each other; run here at two row counts in each dtype so the benchmark
cannot rot (it once did: an import moved and nothing ran it)."""

from __future__ import annotations

import os
import sys

import pytest

from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu, block_matmul as block_matmul_cpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bf16_matmul_cpu.LIBRARY.get() is None or block_matmul_cpu.LIBRARY.get() is None,
                                 reason="the C kernels are not built here (no C compiler)")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_way_is_timed_at_the_rows_it_takes(dtype, capsys):
    import cpu_matmul

    results = cpu_matmul.main(["--dtype", dtype, "--rows", "1,9", "--rounds", "1"])
    assert set(results) == {"decoder linears", "LM head"}
    for group in results.values():
        assert set(group) == {1, 9}
        for rows, ways in group.items():
            assert all(t is None or t > 0 for t in ways.values())
            c_way = next(name for name in ways if name.startswith("C, ") or name.startswith("C pairs"))
            assert ways[c_way] is not None  # the C way takes every row count
    if dtype == "bfloat16":
        assert f"C pairs ({bf16_matmul_cpu.instructions()})" in capsys.readouterr().out
