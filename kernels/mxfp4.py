"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in), torch reference.

Layout, for a linear weight W [N, K] (K a multiple of 32):

  codes   uint8 [N, K / 2]    two e2m1 (FP4) codes a byte along K, the low nibble the even input
  scales  uint8 [N, K / 32]   one e8m0 scale a block of 32 inputs: the power of two 2^(scale - 127)

  W[n, k] = e2m1(code[n, k]) * 2^(scales[n, k // 32] - 127)

which is how OpenAI's release stores each expert's rows (its `*_blocks` [..., K / 32, 16] are these
codes, row by row). Every such value is a bfloat16, so dequantizing is exact.

No triton import here: this module is the CPU path and the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 e2m1 (FP4) codes' values, code 0..15."""
E8M0_BIAS = 127
BLOCK = 32
"""Inputs per scale."""


@dataclass
class Mxfp4Weight:
    """MXFP4 codes [N, K / 2] and e8m0 scales [N, K / 32] of a weight [N, K] (see the module doc)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8 or self.scales.dtype != torch.uint8 or self.codes.dim() != 2:
            raise ValueError(f"MXFP4 codes and scales are 2-D uint8, got {self.codes.dtype} {tuple(self.codes.shape)} "
                             f"and {self.scales.dtype}")
        rows, half = self.codes.shape
        if half % (BLOCK // 2) or tuple(self.scales.shape) != (rows, half * 2 // BLOCK):
            raise ValueError(f"MXFP4 codes {tuple(self.codes.shape)} need scales [{rows}, {half * 2 // BLOCK}] "
                             f"(one per {BLOCK} inputs), got {tuple(self.scales.shape)}")

    @property
    def shape(self) -> Tuple[int, int]:
        rows, half = self.codes.shape  # 2-D, as checked
        return rows, half * 2


def check_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless `blocks` [..., groups, 16] and `scales` [..., groups] pair (OpenAI's layout)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "([..., groups, 16] and [..., groups])")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 blocks [..., groups, 16] (uint8: the low nibble is the even column) and their e8m0 scales
    [..., groups] -> [..., groups * 32] in `dtype` (bfloat16 or wider: exactly)."""
    check_blocks(blocks, scales)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def dense(w: Mxfp4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`."""
    rows, half = w.codes.shape
    return dequantize_mxfp4(w.codes.view(rows, half * 2 // BLOCK, BLOCK // 2), w.scales, dtype)


def mxfp4_matmul_ref(x: torch.Tensor, w: Mxfp4Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) in float32, returned in x.dtype."""
    y = x.to(torch.float32) @ dense(w).t()
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x.dtype)


__all__ = ["BLOCK", "E2M1_VALUES", "E8M0_BIAS", "Mxfp4Weight", "check_blocks", "dense", "dequantize_mxfp4",
           "mxfp4_matmul_ref"]
