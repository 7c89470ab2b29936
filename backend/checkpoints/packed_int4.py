"""AWQ (GEMM) and GPTQ 4-bit checkpoints: their packed projections are collected
while the tensors stream in, then fused per the model's `packed_modules` table
(q/k/v into qkv_proj, gate/up into gate_up_proj) into INT4 QuantizedLinears.
Fusing needs every part of a module, so it waits until the stream has ended."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from pagedserve.kernels.dispatch import int4_linear
from pagedserve.kernels.int4 import Int4Weight
from pagedserve.kernels.int4_checkpoints import int4_from_awq, int4_from_gptq

from ..quantization import QuantizedLinear

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

    def __init__(self, packed_modules: Mapping[str, tuple[str, ...]], checkpoint_format: str, group_size: int):
        self.packed_modules = packed_modules
        self.projections = {part for parts in packed_modules.values() for part in parts}
        self.format = checkpoint_format
        self.group_size = group_size
        self.parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def accepts(self, module: str, kind: str) -> bool:
        return module in self.projections and kind in PACKED_SUFFIXES

    def add(self, layer: int, module: str, kind: str, tensor: torch.Tensor) -> None:
        self.parts.setdefault((layer, module), {})[kind] = tensor

    def _unpack(self, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        if self.format == "awq":
            return int4_from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size)
        return int4_from_gptq(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], None, self.group_size, self.format
        )

    def install(self, layers: nn.ModuleList, device: torch.device, dtype: torch.dtype) -> None:
        for index, layer in enumerate(layers):
            for target, names in self.packed_modules.items():
                missing = [n for n in names if (index, n) not in self.parts]
                if missing:
                    raise ValueError(f"checkpoint lacks packed weights of layer {index} {missing}")
                tensors = [self.parts.pop((index, n)) for n in names]
                weight = concat_out_features([self._unpack(t) for t in tensors]).to(device)
                biases = [t["bias"] for t in tensors if t.get("bias") is not None]
                bias = torch.cat(biases).to(device, dtype) if len(biases) == len(tensors) else None
                layer.set_submodule(target, QuantizedLinear(weight, bias, int4_linear))
