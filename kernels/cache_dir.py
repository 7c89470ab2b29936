"""The project's cache directory, shared by everything that keeps files between runs: compiled C
kernels (kernels/cpu/native_build.py), timed GEMM choices (kernels/triton/gemm.py), converted
tokenizers, inductor's code and the CPU matmul probe's verdict."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The project's cache directory: $PAGEDSERVE_CACHE_DIR, default ~/.cache/pagedserve
    (converted tokenizers, compiled C kernels, inductor's code)."""
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")


__all__ = ["cache_root"]
