"""The static kernel report of a run (tests/kernels/test_aot_compile.py's `test_static_report`):
what each target's compiled configurations need (registers, spills, shared memory) and how many
programs one decode token's quantized GEMMs launch against the SMs, with no GPU. The full report
goes to a file; tests/conftest.py prints the summary after the run. A plain module (not collected)."""

from __future__ import annotations

LINES: list[str] = []
PATH: list[str] = []


def summary() -> list[str]:
    """The lines to print at the end of the run (none when the report was not made)."""
    return LINES + [f"full report: {PATH[0]}"] if PATH else []
