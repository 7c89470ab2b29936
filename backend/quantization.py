"""Quantize-on-load: the decoder's linear layers become INT4 (W4A16) or FP8 ones.

Embeddings, norms, the LM head and the last decoder layer stay in the compute
dtype: the last layer feeds the LM head directly and is by far the most
sensitive (on the default model, FP8 in that one layer alone costs +1.3%
perplexity, as much as the other 29 together). Each QuantizedLinear calls the
kernel dispatcher: the Triton kernel on CUDA, the torch reference (dequantize,
then matmul) elsewhere.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from pagedserve.kernels.fp8 import quantize_fp8
from pagedserve.kernels.int4 import Int4Weight, int4_from_awq, int4_from_gptq, quantize_int4
from pagedserve.kernels.linear import fp8_linear, int4_linear

from .models.llama import LlamaForCausalLM

QUANTIZED_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class QuantizedLinear(nn.Module):
    def __init__(self, weight: Any, bias: torch.Tensor | None, kernel: Callable[..., torch.Tensor]):
        super().__init__()
        self.weight = weight  # Int4Weight or Fp8Weight (not an nn.Parameter: packed layouts)
        self.bias = bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


def int4_group_size(in_features: int, source_group_size: int | None = None) -> int:
    """The checkpoint's own 4-bit block size when it has one (re-quantizing a GGUF Q4_1
    with its 32-wide blocks is then exact: scale = d, offset = m); otherwise 128, the
    usual group, where it divides the input width, else the largest of 64, 32, 16."""
    preferred = [source_group_size] if source_group_size and source_group_size <= 128 else []
    for size in preferred + [128, 64, 32, 16]:
        if in_features % size == 0:
            return size
    raise ValueError(f"INT4 needs an input width divisible by 16, got {in_features}")


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
    """Replace the decoder layers' linear layers in place (frees the dense weights)."""
    layers = list(model.layers)[: len(model.layers) - keep_last_layers]
    for layer in tqdm(layers, desc=f"Quantizing to {method}", unit="layer", leave=False):
        for module_name, linear_name in QUANTIZED_LINEARS:
            parent = getattr(layer, module_name)
            linear = quantize_linear(getattr(parent, linear_name), method, model.config.source_group_size)
            setattr(parent, linear_name, linear)


# -- packed 4-bit checkpoints (AWQ GEMM, GPTQ) -----------------------------------------
# Hugging Face projection -> (our fused module, its part index)
FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
PART_COUNT = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
# (PART_COUNT's keys are the fused modules, in no particular order; parts are sorted by index)
PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")


def concat_out_features(parts: list[Int4Weight]) -> Int4Weight:
    """Fuse linears that share their input (q/k/v, gate/up) into one packed weight."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.in_features != first.in_features or p.perm is not None for p in parts):
        raise ValueError("fused 4-bit parts need the same input width and group size and no act-order")
    return Int4Weight(
        qweight=torch.cat([p.qweight for p in parts], dim=1),
        scales=torch.cat([p.scales for p in parts], dim=1),
        offsets=torch.cat([p.offsets for p in parts], dim=1),
        group_size=first.group_size,
        shape=(sum(p.out_features for p in parts), first.in_features),
    )


class PackedInt4Loader:
    """Collects a checkpoint's packed projections and installs our fused QuantizedLinears."""

    def __init__(self, checkpoint_format: str, group_size: int):
        self.format = checkpoint_format
        self.group_size = group_size
        self.parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    @staticmethod
    def accepts(module: str, kind: str) -> bool:
        return module in FUSED_PARTS and kind in PACKED_SUFFIXES

    def add(self, layer: int, module: str, kind: str, tensor: torch.Tensor) -> None:
        self.parts.setdefault((layer, module), {})[kind] = tensor

    def _unpack(self, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        if self.format == "awq":
            return int4_from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size)
        return int4_from_gptq(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], None, self.group_size, self.format
        )

    def install(self, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> None:
        for index, layer in enumerate(model.layers):
            for target in PART_COUNT:
                names = sorted((n for n, (t, _) in FUSED_PARTS.items() if t == target), key=lambda n: FUSED_PARTS[n][1])
                missing = [n for n in names if (index, n) not in self.parts]
                if missing:
                    raise ValueError(f"checkpoint lacks packed weights of layer {index} {missing}")
                tensors = [self.parts.pop((index, n)) for n in names]
                weight = concat_out_features([self._unpack(t) for t in tensors]).to(device)
                biases = [t.get("bias") for t in tensors]
                bias = torch.cat(biases).to(device, dtype) if all(b is not None for b in biases) else None
                parent_name, _, attr = target.partition(".")
                setattr(getattr(layer, parent_name), attr, QuantizedLinear(weight, bias, int4_linear))
