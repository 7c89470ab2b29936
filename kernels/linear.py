"""Quantized linear dispatch: Triton kernel for CUDA tensors, torch reference otherwise.

PAGEDSERVE_FORCE_TRITON=1 sends CPU tensors to the Triton kernels too, which only
works together with TRITON_INTERPRET=1 (set before triton is first imported); that is
how the kernels are exercised on machines without a GPU. Triton modules are imported
inside the dispatch branch so the CPU path never needs triton installed.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .fp8 import Fp8Weight, fp8_matmul_ref
from .int4 import Int4Weight, w4a16_matmul_ref


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("PAGEDSERVE_FORCE_TRITON", "0") == "1"


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with a packed INT4 weight; returns x.dtype [..., N]."""
    if _use_triton(x):
        from .int4_triton import w4a16_matmul_triton

        return w4a16_matmul_triton(x, w, bias)
    return w4a16_matmul_ref(x, w, bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ (weight * scale)^T (+ bias) with an e4m3 weight; returns x.dtype [..., N].

    On GPUs with compute capability >= 8.9 the activations are quantized per token to
    e4m3 (FP8 tensor cores); elsewhere the weight is upconverted (W8A16, as the reference).
    """
    if _use_triton(x):
        from .fp8_triton import fp8_matmul_triton

        return fp8_matmul_triton(x, w, bias)
    return fp8_matmul_ref(x, w, bias)
