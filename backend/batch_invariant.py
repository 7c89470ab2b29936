"""`deterministic` on a GPU: the model's kernels swapped, once at load, for launches whose
per-row arithmetic does not depend on the batch (kernels/triton/batch_invariant.py says why a
GPU step otherwise differs in the last bits beside other requests).

What changes: every dense linear multiplies through the fixed-tile Triton GEMM (a `LinearMethod`,
as the CPU's weight layouts are), every RMSNorm runs one row a program, the MoE kernels keep one
tile, the attention takes its batch-invariant launch (the runner asks `attention_kernels` for it)
and the sampler's logprobs come from a row-wise log-softmax. What stays: elementwise work (rotary,
activations, residual adds), the router's softmax over a few experts (one warp a row in torch) and
the argmax (exact), which no batch can change; and the CUDA graphs, which replay these same kernels.
On CPU the same setting is the CPU backend's (backend/cpu/backend.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.dispatch import invariant_linear, triton_wanted

from .config import EngineConfig
from .errors import ConfigError
from .models.linear import Linear
from .models.llama import RMSNorm
from .models.moe import SparseMoeBlock


def runs_invariant_kernels(config: EngineConfig, device: torch.device) -> bool:
    """Whether this engine's `deterministic` is the Triton kernels' (on CUDA, or wherever the Triton
    kernels are forced), not the CPU backend's."""
    return config.deterministic and triton_wanted(device)


class InvariantMatmul:
    """A dense linear's method under `deterministic` on a GPU: the plain weight, the fixed-tile GEMM."""

    reads_plain_weight = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, layer.weight, layer.bias)


def make_batch_invariant(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every dense linear, norm and MoE block of `model` its batch-invariant kernel. A float32
    MoE model is refused: its experts run the torch reference, whose matmuls take each expert's rows."""
    method = InvariantMatmul()
    for module in model.modules():
        if isinstance(module, Linear):
            module.method = method
        elif isinstance(module, RMSNorm):
            module.batch_invariant = True
        elif isinstance(module, SparseMoeBlock):
            if dtype == torch.float32:
                raise ConfigError("deterministic", "a mixture-of-experts model runs it in bfloat16 or float16 on a GPU; "
                                                   "set dtype='bfloat16' or deterministic=false")
            module.batch_invariant = True


__all__ = ["InvariantMatmul", "make_batch_invariant", "runs_invariant_kernels"]
