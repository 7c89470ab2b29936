"""The model's dense linear layer: nn.Linear whose CPU half-precision calls see a few row counts.

On CPU, torch runs bf16/fp16 matmuls through oneDNN, which builds a kernel for every
input shape (3-4 ms each on a 2-core machine) and keeps up to 1,024 of them (a few
hundred KB each). The row count is the step's token count, which changes nearly every
step: without buckets each new count pays the build and the cache grows to hundreds of
MB over a long run. Rows padded to a bucket (a multiple of 16 up to 256, of 64 up to
1,024, then of 256) leave a few dozen shapes per layer. Rows are independent in a
matmul, so the padding rows (zeros) change nothing in the real ones. float32 (MKL)
and CUDA need no buckets and take the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def row_bucket(rows: int) -> int:
    """The padded row count for `rows`: itself up to 16, else the next multiple of 16
    (<= 256 rows), 64 (<= 1,024) or 256."""
    if rows <= 16:
        return rows
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


def needs_buckets(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        bucket = row_bucket(rows) if needs_buckets(x) else rows
        if bucket == rows:
            return F.linear(x, self.weight, self.bias)
        padded = x.new_zeros((bucket, x.shape[1]))
        padded[:rows] = x
        return F.linear(padded, self.weight, self.bias)[:rows]
