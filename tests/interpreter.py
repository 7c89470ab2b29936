"""What the bit-for-bit tests of the Triton kernels rest on when they run in Triton's interpreter
(TRITON_INTERPRET=1, CPU), and the dot product that makes them test our kernels rather than the
machine's BLAS. A plain module (not collected).

`deterministic`'s promise on a GPU rests on two things: our launches fix every tile, split and
loop order by the weight's shape, the dtype and the device, never by the batch
(kernels/triton/batch_invariant.py); and the hardware's MMA instructions sum every output of a
tile in one order, whatever its row. The interpreter runs the first as written but hands each
`tl.dot` to numpy's matmul, that is to the BLAS numpy was built with (OpenBLAS), whose sgemm
kernel is picked at run time by the CPU. Some of them sum a tile's rows in orders that depend on
the row's place in the tile: with OpenBLAS 0.3.23's Haswell kernels (AVX2 CPUs, and CPUs it does
not know, such as AMD's family 26) rows 6-11 of every 12 come out otherwise than rows 0-5
(`OPENBLAS_CORETYPE=Haswell` shows it on any x86 CPU). A request's rows sit at other places beside
other requests, so there its logprobs differed in the last bits: the interpreter's BLAS, not our
kernels, and nothing a GPU does.

`k_ordered_dot` is the interpreter's dot with every output summed from k = 0 up, the same code for
each row, as an MMA tile treats its rows alike; the bit-for-bit tests install it
(`use_row_uniform_dot`) so that they check our launches' part of the promise on every CPU, and
`blas_rows_uniform` says whether this machine's BLAS would have kept it too (the suite's summary
line). On a GPU none of this applies: the tests run the compiled kernels as they are served.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest

TILE_ROWS = (16, 32, 64)
"""Row counts of the tiles the probe multiplies (the BLOCK_M values our launches use)."""


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (the kernels' own switch; imported here only when
    asked, so collecting the tests does not import triton)."""
    from pagedserve.kernels.triton.gemm import interpreting as kernels_interpreting

    return kernels_interpreting()


def k_ordered_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """InterpreterBuilder.create_dot whose every output is acc + a[m, 0] b[0, n] + a[m, 1] b[1, n] + ...
    in that order (elementwise numpy arithmetic: no BLAS, no reassociation), the same for each row."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _convert_float

    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
        a_data = _convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        b_data = _convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
    acc = np.array(d.data, copy=True)
    a_wide, b_wide = a_data.astype(acc.dtype), b_data.astype(acc.dtype)
    for k in range(a_wide.shape[-1]):
        acc += a_wide[..., :, k:k + 1] * b_wide[..., k:k + 1, :]
    return TensorHandle(acc, d.dtype.scalar)


def use_row_uniform_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tl.dot replaced by `k_ordered_dot` for the test (nothing off the interpreter)."""
    if interpreting():
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_dot", k_ordered_dot)


@functools.cache
def blas_rows_uniform() -> bool:
    """Whether numpy's matmul (the interpreter's own tl.dot) gives a row the same bits at every place
    in a tile of TILE_ROWS rows: one row among zeros (a masked tile) against the same row at each
    place among other rows."""
    rng = np.random.default_rng(0)
    for rows in TILE_ROWS:
        for depth in (16, 64):
            row = rng.standard_normal((1, depth), dtype=np.float32)
            weight = rng.standard_normal((depth, 64), dtype=np.float32)
            alone = np.zeros((rows, depth), np.float32)
            alone[0] = row
            expected = np.matmul(alone, weight)[0]
            for place in range(rows):
                beside = rng.standard_normal((rows, depth), dtype=np.float32)
                beside[place] = row
                if not np.array_equal(np.matmul(beside, weight)[place], expected):
                    return False
    return True


def blas_name() -> str:
    """numpy's BLAS and, for OpenBLAS, the kernel family it picked for this CPU."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    for path in libs:
        library = ctypes.CDLL(path)
        for symbol in ("openblas_get_corename64_", "openblas_get_corename", "scipy_openblas_get_corename"):
            function = getattr(library, symbol, None)
            if function is not None:
                function.restype = ctypes.c_char_p
                return f"OpenBLAS, {function().decode()} kernels"
    return "numpy's BLAS"
