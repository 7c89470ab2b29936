"""Numeric constants and integer helpers shared by the kernels and the engine.

Defined once here so the fp8 quantizers, the KV cache writers, the calibration in
the engine and every tiling computation agree; this module imports only torch.
"""

from __future__ import annotations

from typing import TypeVar

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_EPS = 1e-12
"""Floor on an amax before it becomes a scale, so all-zero rows do not divide by zero."""


_Count = TypeVar("_Count", int, torch.Tensor)


def cdiv(a: _Count, b: int) -> _Count:
    """Ceiling of a / b for integers (b > 0)."""
    return -(-a // b)
