"""FP8 (e4m3fn) weights with per-output-channel or block-wise scales, torch reference; and int8
weights with the same scales (`Int8Weight`, W8A16 checkpoints), which share the FP8 GEMM's
16-bit-activation path.

Layout: weight float8_e4m3fn [N, K] (row n = output channel, K contiguous, which is
the K-major B operand FP8 tensor cores want) and fp32 scales, either
* per channel: scale [N], W[n, k] = weight[n, k] * scale[n]; or
* per channel and group of `group_size` input features: scale [N, ceil(K / group_size)],
  W[n, k] = weight[n, k] * scale[n, k // group_size]. Block-wise checkpoints (DeepSeek-style
  `weight_block_size`, one scale per 128 x 128 block) are read into this form with each block's
  scale repeated over its rows (`fp8_from_blocks`): fused q/k/v or gate/up then stack rows as
  the per-channel form does, whatever their row counts.
Activations for the FP8 tensor-core path are quantized per token (row):
x_fp8 [M, K], x_scale fp32 [M], x[m, k] ~ x_fp8[m, k] * x_scale[m].

Scales map each row's absolute maximum to the e4m3 maximum 448; values are divided by
the scale (IEEE division), clamped to +-448 and rounded to nearest even by the cast.

No triton import here: this module is the CPU path and the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional, Tuple

import torch

from .numerics import AMAX_EPS, FP8_DTYPE, FP8_MAX, cdiv

GROUP_MULTIPLE = 16
"""A group size is a multiple of this: the Triton kernel's K tiles (at least 16 for `tl.dot`)
must each lie inside one group."""


@dataclass
class Fp8Weight:
    """e4m3 weight [N, K] and its fp32 scales: [N] per output channel (group_size 0), or
    [N, ceil(K / group_size)] per output channel and group of input features."""

    weight: torch.Tensor
    scale: torch.Tensor
    group_size: int = 0
    CODES: ClassVar[torch.dtype] = FP8_DTYPE

    def __post_init__(self) -> None:
        if self.weight.dtype != self.CODES or self.weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {self.CODES} tensor, got {self.weight.dtype}")
        rows, cols = self.weight.shape
        if self.group_size and (self.group_size < 0 or self.group_size % GROUP_MULTIPLE):
            raise ValueError(f"group_size must be a positive multiple of {GROUP_MULTIPLE}, got {self.group_size}")
        expected = (rows, cdiv(cols, self.group_size)) if self.group_size else (rows,)
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expected:
            raise ValueError(f"scale must be fp32 {list(expected)}, got {self.scale.dtype} {list(self.scale.shape)}")

    @property
    def shape(self) -> Tuple[int, int]:
        rows, cols = self.weight.shape  # 2-D, as checked
        return rows, cols

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def to(self, device) -> "Fp8Weight":
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device))

    def scale_per_column(self) -> torch.Tensor:
        """The scale of every weight element's column group, [N, K] (grouped form) or [N, 1]."""
        if not self.group_size:
            return self.scale.unsqueeze(1)
        return self.scale.repeat_interleave(self.group_size, dim=1)[:, : self.weight.shape[1]]


@dataclass
class Int8Weight(Fp8Weight):
    """int8 codes [N, K] with Fp8Weight's scales, W = code * scale (llm-compressor's W8A16 and int8
    W8A8 checkpoints). Multiplied by the 16-bit activations as they are (the codes are exact in
    bf16), never quantized per token: W8A8 checkpoints run as W8A16."""

    CODES: ClassVar[torch.dtype] = torch.int8


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


def quantize_fp8_blocks(weight: torch.Tensor, block: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight as block-wise FP8 checkpoints store it: e4m3 codes [N, K] and one fp32
    scale per `block` (rows, columns) tile, [ceil(N / rows), ceil(K / columns)] (the tensor
    DeepSeek-style checkpoints name weight_scale_inv: weight = codes * scale)."""
    rows, cols = block
    n, k = weight.shape
    padded = torch.zeros(cdiv(n, rows) * rows, cdiv(k, cols) * cols, dtype=torch.float32)
    padded[:n, :k] = weight.detach().to(torch.float32)
    tiles = padded.view(cdiv(n, rows), rows, cdiv(k, cols), cols)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=AMAX_EPS) / FP8_MAX
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view_as(padded)[:n, :k].contiguous(), scale


def fp8_from_blocks(codes: torch.Tensor, block_scale: torch.Tensor, block: Tuple[int, int]) -> Fp8Weight:
    """The grouped Fp8Weight of block-wise codes [N, K] and scales [ceil(N / rows), ceil(K / columns)]:
    each block's scale repeated over its rows (group_size = the block's columns)."""
    rows, cols = block
    n, k = codes.shape
    if tuple(block_scale.shape) != (cdiv(n, rows), cdiv(k, cols)):
        raise ValueError(f"a [{n}, {k}] weight in {rows} x {cols} blocks has [{cdiv(n, rows)}, {cdiv(k, cols)}] "
                         f"scales, got {list(block_scale.shape)}")
    scale = block_scale.to(torch.float32).repeat_interleave(rows, dim=0)[:n]
    return Fp8Weight(codes.contiguous(), scale.contiguous(), group_size=cols)


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w.weight.to(torch.float32) * w.scale_per_column()).to(dtype)


def fp8_matmul_ref(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A16: y = x @ (weight * scale)^T (+ bias) in fp32, returned in x.dtype.

    A channel scale is applied to the [M, N] product instead of the [N, K] weight; group
    scales to the weight.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    if w.group_size:
        y = x.reshape(-1, k).to(torch.float32) @ dequantize_fp8(w).t()
    else:
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
    if w.group_size:
        y = (xq.to(torch.float32) @ dequantize_fp8(w).t()).mul_(xs.unsqueeze(1))
    else:
        y = xq.to(torch.float32) @ w.weight.to(torch.float32).t()
        y.mul_(xs.unsqueeze(1)).mul_(w.scale)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x.dtype).view(*lead, n)
