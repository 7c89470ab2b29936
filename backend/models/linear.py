"""The model's dense linear layer: nn.Linear that multiplies the way its method says.

A layer's weight can be laid out for the kernel that multiplies it fastest, and how it is
multiplied follows from that layout alone. So the layout and its matmul are one object, a
`LinearMethod`, given to the layer once at load (vLLM's quant-method pattern): the layer asks
its method and never tests which form its weight takes. Without a method (CUDA, the compiled
step, a layer no method fits) it is nn.Linear. The CPU's methods (GGUF blocks, bf16 pairs,
oneDNN-packed, transposed) and how one is chosen per layer are the CPU backend's
(backend/cpu/linear_methods.py); the quantized linears are modules of their own
(backend/quantization.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def row_bucket(rows: int, exact: int = 16) -> int:
    """The padded row count for `rows`: itself up to `exact`, else the next multiple of 16
    (<= 256 rows), 64 (<= 1,024) or 256. A kernel built per input shape (oneDNN's on CPU, a
    compiled graph or CUDA graph per row count) then sees a few shapes, not one per step."""
    if rows <= exact:
        return rows
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


class LinearMethod(Protocol):
    """How one layer's weight is multiplied: its layout and the kernel that reads it."""

    @property
    def reads_plain_weight(self) -> bool:
        """Whether `apply` still reads the layer's `weight` (so it must stay)."""
        ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W^T (+ the layer's bias): [..., out] in x's dtype."""
        ...


class Linear(nn.Linear):
    method: LinearMethod | None = None
    """How this layer multiplies, chosen at load; None: nn.Linear's matmul over `weight`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        method = self.method
        return F.linear(x, self.weight, self.bias) if method is None else method.apply(self, x)

    @property
    def reads_plain_weight(self) -> bool:
        """Whether the layer multiplies by `weight` (so it must stay)."""
        return self.method is None or self.method.reads_plain_weight
