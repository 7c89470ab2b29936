"""FP8 (e4m3fn) weights with per-output-channel scales, torch reference.

Layout: weight float8_e4m3fn [N, K] (row n = output channel, K contiguous, which is
the K-major B operand FP8 tensor cores want), scale fp32 [N]; W[n, k] = weight[n, k] *
scale[n]. Activations for the FP8 tensor-core path are quantized per token (row):
x_fp8 [M, K], x_scale fp32 [M], x[m, k] ~ x_fp8[m, k] * x_scale[m].

Scales map each row's absolute maximum to the e4m3 maximum 448; values are divided by
the scale (IEEE division), clamped to +-448 and rounded to nearest even by the cast.

No triton import here: this module is the CPU path and the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

from .numerics import AMAX_EPS, FP8_DTYPE, FP8_MAX


@dataclass
class Fp8Weight:
    """e4m3 weight [N, K] and its per-output-channel fp32 scale [N]."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {FP8_DTYPE} tensor, got {self.weight.dtype}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.weight.shape[0],):
            raise ValueError(f"scale must be fp32 [{self.weight.shape[0]}]")

    @property
    def shape(self) -> Tuple[int, int]:
        rows, cols = self.weight.shape  # 2-D, as checked
        return rows, cols

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def to(self, device) -> "Fp8Weight":
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device))


def quantize_rows(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales of every row (the last dimension) of `t`, any leading dims."""
    t = t.to(torch.float32)
    amax = t.abs().amax(dim=-1).clamp(min=AMAX_EPS)
    # a tensor divisor: torch on CUDA multiplies by a scalar divisor's reciprocal, which
    # can differ from amax / 448 in the last bit (the Triton twin divides exactly)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (t / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Per-output-channel e4m3 quantization of a [N, K] weight (round to nearest even)."""
    q, scale = quantize_rows(weight.detach())
    return Fp8Weight(weight=q.contiguous(), scale=scale.contiguous())


def quantize_per_token_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: x [M, K] -> (e4m3 [M, K], fp32 scale [M])."""
    return quantize_rows(x.detach())


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w.weight.to(torch.float32) * w.scale.unsqueeze(1)).to(dtype)


def fp8_matmul_ref(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A16: y = x @ (weight * scale)^T (+ bias) in fp32, returned in x.dtype.

    The channel scale is applied to the [M, N] product instead of the [N, K] weight.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    y = x.reshape(-1, k).to(torch.float32) @ w.weight.to(torch.float32).t()
    y.mul_(w.scale)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x.dtype).view(*lead, n)


def fp8_w8a8_matmul_ref(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the FP8 tensor-core path computes: per-token e4m3 activations times e4m3
    weights, both scales applied to the fp32 product. Oracle for that kernel."""
    n, k = w.shape
    lead = x.shape[:-1]
    xq, xs = quantize_per_token_fp8(x.reshape(-1, k))
    y = xq.to(torch.float32) @ w.weight.to(torch.float32).t()
    y.mul_(xs.unsqueeze(1)).mul_(w.scale)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x.dtype).view(*lead, n)
