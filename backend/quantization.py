"""Quantize-on-load: the decoder's linear layers become INT4 (W4A16) or FP8 ones.

Embeddings, norms, the LM head and the last decoder layer stay in the compute
dtype: the last layer feeds the LM head directly and is by far the most
sensitive (on the default model, FP8 in that one layer alone costs +1.3%
perplexity, as much as the other 29 together). Each QuantizedLinear calls the
kernel dispatcher: the Triton kernel on CUDA, the torch reference (dequantize,
then matmul) elsewhere. Which linears are quantized is the model's `packed_modules`
table; checkpoints already quantized (4-bit, FP8) load through checkpoints/prequantized.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from pagedserve.kernels.dispatch import fp8_linear, int4_linear
from pagedserve.kernels.fp8 import quantize_fp8
from pagedserve.kernels.int4 import int4_group_size, quantize_int4

from .models.llama import LlamaForCausalLM
from .models.moe import SparseMoeBlock


class QuantizedLinear(nn.Module):
    def __init__(self, weight: Any, bias: torch.Tensor | None, kernel: Callable[..., torch.Tensor]):
        super().__init__()
        self.weight = weight  # Int4Weight or Fp8Weight (not an nn.Parameter: packed layouts)
        self.bias = bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def quantize_linear(linear: nn.Linear, method: str, source_group_size: int | None = None) -> QuantizedLinear:
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    if method == "int4":
        group = int4_group_size(weight.shape[1], source_group_size)
        return QuantizedLinear(quantize_int4(weight, group), bias, int4_linear)
    if method == "fp8":
        return QuantizedLinear(quantize_fp8(weight), bias, fp8_linear)
    raise ValueError(f"unknown quantization {method!r}")


@torch.inference_mode()
def quantize_model(model: LlamaForCausalLM, method: str, keep_last_layers: int = 1) -> None:
    """Replace the decoder layers' linear layers in place (frees the dense weights); a mixture of
    experts' experts are quantized the same way, its router kept in the model dtype."""
    layers = list(model.decoder_layers)[: len(model.layers) - keep_last_layers]
    for layer in tqdm(layers, desc=f"Quantizing to {method}", unit="layer", leave=False):
        for name in model.linears_of(layer):
            layer.set_submodule(name, quantize_linear(layer.get_submodule(name), method, model.config.source_group_size))
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.quantize(method, model.config.source_group_size)
