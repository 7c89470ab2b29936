"""Which paths of `deterministic`'s promise (the same bits alone and in any batch) the run checked to
the bit on this machine: the tests marked `bit_exact(path)` counted per path, printed by
tests/conftest.py at the end of the run beside the C kernels' instruction sets. A plain module (not
collected).

Paths: "cpu", the CPU backend's (the C kernels, and oneDNN for float32 / float16 layers);
"triton", the Triton kernels' (compiled on a GPU; on CPU in the interpreter, with the MMA-like dot
of tests/interpreter.py); "engine", whichever of the two an engine runs here.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from .interpreter import blas_name, blas_rows_uniform, interpreting

PATHS = ("cpu", "triton")
OUTCOMES: dict[str, Counter] = defaultdict(Counter)
"""path -> outcome ("passed", "failed", "skipped") -> tests"""
MARKED: dict[str, str] = {}
"""test id -> path"""


def path_of(marker_arg: str) -> str:
    if marker_arg == "engine":
        return "triton" if torch.cuda.is_available() else "cpu"
    if marker_arg not in PATHS:
        raise ValueError(f"bit_exact path {marker_arg!r} is not one of {PATHS} or 'engine'")
    return marker_arg


def mark(items: list) -> None:
    """Note each collected test's bit_exact path (pytest_collection_modifyitems)."""
    for item in items:
        marker = item.get_closest_marker("bit_exact")
        if marker is not None:
            MARKED[item.nodeid] = path_of(marker.args[0])


def record(report) -> None:
    """Count a marked test's outcome (pytest_runtest_logreport): its call, or a setup that skipped or failed."""
    path = MARKED.get(report.nodeid)
    if path is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    OUTCOMES[path][report.outcome] += 1


def _counts(path: str) -> str:
    counts = OUTCOMES.get(path)
    if not counts:
        return "not run"
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))


def summary() -> str | None:
    """One line: each path, how it ran here and its tests' outcomes; None when no marked test ran."""
    if not OUTCOMES:
        return None
    if torch.cuda.is_available():
        triton = f"Triton kernels compiled on {torch.cuda.get_device_name()}"
    elif interpreting():
        own = "keeps" if blas_rows_uniform() else "does not keep"
        triton = (f"Triton kernels in the interpreter, their tl.dot summed in k order as a GPU's MMA sums "
                  f"(numpy's own matmul, {blas_name()}, {own} a tile's rows alike here), not compiled for a GPU")
    else:
        triton = "Triton kernels"
    return f"CPU backend (C kernels, oneDNN): {_counts('cpu')}; {triton}: {_counts('triton')}"
