"""Checkpoints whose linear weights are quantized already, loaded as they are (never through bf16):

- 4-bit: AWQ (GEMM), GPTQ (v1, v2) and compressed-tensors' pack-quantized (llm-compressor's W4A16,
  symmetric or with zero points, per group or per channel), repacked into our INT4 layout;
- FP8: e4m3 weights with per-tensor or per-channel scales, as compressed-tensors' float-quantized
  (llm-compressor's FP8 W8A8, static or dynamic), ModelOpt's FP8 and AutoFP8 write them; and
  block-wise ones (one scale per rows x columns tile: DeepSeek-style `weight_scale_inv`, or
  compressed-tensors' block strategy), whose block scales become group scales repeated over each
  block's rows (kernels/fp8.py). Activation scales are not read: our FP8 GEMM quantizes the
  activations per token as they come (sm_89+; W8A16 before it and on CPU), which needs no
  calibrated scale;
- int8: compressed-tensors' symmetric 8-bit weights (W8A16 pack-quantized, or int-quantized as W8A8
  checkpoints store them), per channel or group, run by the FP8 GEMM's W8A16 path (`Int8Weight`):
  W8A8 checkpoints run with their activations unquantized.

A format's projections are collected while the tensors stream in, then fused per the model's
`packed_modules` table (q/k/v into qkv_proj, gate/up into gate_up_proj) into QuantizedLinears.
Fusing needs every part of a module, so it waits until the stream has ended. A mixture of
experts' experts (experts.E.gate_proj / up_proj / down_proj) are read the same way, each expert's
gate / up fused, and stacked into its layer's SparseMoeBlock (the fused MoE kernels' fp8, int8 and
int4 forms); the router stays as the checkpoint has it, unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from pagedserve.kernels.dispatch import fp8_linear, int4_linear
from pagedserve.kernels.fp8 import Fp8Weight, Int8Weight, fp8_from_blocks
from pagedserve.kernels.int4 import Int4Weight
from pagedserve.kernels.int4_checkpoints import (
    int4_from_awq,
    int4_from_compressed_tensors,
    int4_from_gptq,
    unpack_along_last,
)
from pagedserve.kernels.moe import stack_experts
from pagedserve.kernels.numerics import FP8_DTYPE

from ..errors import ConfigError
from ..model_config import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..models.moe import EXPERT_PROJECTIONS, SparseMoeBlock
from ..quantization import QuantizedLinear


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


def concat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    """Fuse 8-bit linears that share their input: rows and their channel (or group) scales stacked."""
    return type(parts[0])(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].group_size)


def fp8_blocks_from_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig) -> Fp8Weight:
    """A block-wise e4m3 weight and its block scales, named weight_scale_inv (DeepSeek-style) or
    weight_scale (compressed-tensors)."""
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
    if scale is None:
        raise KeyError("weight_scale_inv")
    assert config.fp8_block is not None  # set with packed_weights "fp8-block"
    return fp8_from_blocks(_e4m3(tensors["weight"]), scale, config.fp8_block)


def int8_from_compressed_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> Int8Weight:
    """compressed-tensors' symmetric 8-bit weights: int-quantized (`weight`, int8 [N, K]) or pack-quantized
    (`weight_packed`, int32 [N, ceil(K / 4)], byte i of word c holding input 4c + i offset by 128), with
    `weight_scale` [N, 1] per channel or [N, ceil(K / G)] per group. W = code * scale."""
    scale = tensors["weight_scale"].to(torch.float32)
    if "weight_packed" in tensors:
        stored = unpack_along_last(tensors["weight_packed"].to(torch.int32), bits=8)
        codes = (stored.to(torch.int16) - 128).to(torch.int8)
        codes = codes[:, : int(tensors["weight_shape"][1])] if "weight_shape" in tensors else codes
    else:
        codes = tensors["weight"]
        if codes.dtype != torch.int8:
            raise ValueError(f"an int8 checkpoint's weight is {codes.dtype}, expected torch.int8")
    if scale.dim() == 2 and scale.shape[1] == 1:
        return Int8Weight(codes.contiguous(), scale.reshape(-1).contiguous())
    return Int8Weight(codes.contiguous(), scale.contiguous(), group_size=_group(config))


def _e4m3(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"an FP8 checkpoint's weight is {weight.dtype}, expected {FP8_DTYPE}")
    return weight


def fp8_from_checkpoint(weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    """An e4m3 weight [N, K] and its scale as stored: one for the tensor ([] or [1]) or one per output
    channel ([N] or [N, 1]); a per-tensor scale becomes N equal channel scales (exact)."""
    rows = _e4m3(weight).shape[0]
    scale = scale.to(torch.float32).reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(rows)
    elif scale.numel() != rows:
        raise ValueError(f"weight_scale of {scale.numel()} values for {rows} rows: per-tensor or per-channel "
                         "scales expected (block-wise checkpoints name their weight_block_size)")
    return Fp8Weight(weight.contiguous(), scale.contiguous())


@dataclass(frozen=True)
class PrequantizedFormat:
    """How one format's projections are read (`kinds`: their tensors' suffixes), fused and run."""

    kinds: tuple[str, ...]
    read: Callable[[dict[str, torch.Tensor], ModelConfig], Any]
    """The projection's tensors and the checkpoint's config (its group or block size) -> its weight in
    our layout."""
    concat: Callable[[list[Any]], Any]
    kernel: Callable[..., torch.Tensor]


Reader = Callable[[dict[str, torch.Tensor], ModelConfig], Any]


def _group(config: ModelConfig) -> int:
    return config.source_group_size or 0


def _gptq(fmt: str) -> Reader:
    return lambda t, c: int4_from_gptq(t["qweight"], t["qzeros"], t["scales"], None, _group(c), fmt)


def _int4(kinds: tuple[str, ...], read: Reader) -> PrequantizedFormat:
    return PrequantizedFormat(kinds, read, concat_out_features, int4_linear)


def _fp8(kinds: tuple[str, ...], read: Reader) -> PrequantizedFormat:
    return PrequantizedFormat(kinds + ("input_scale", "bias"), read, concat_fp8, fp8_linear)


_GPTQ_KINDS = ("qweight", "qzeros", "scales", "g_idx", "bias")
FORMATS: dict[str, PrequantizedFormat] = {
    "awq": _int4(_GPTQ_KINDS, lambda t, c: int4_from_awq(t["qweight"], t["qzeros"], t["scales"], _group(c))),
    "gptq": _int4(_GPTQ_KINDS, _gptq("gptq")),
    "gptq_v2": _int4(_GPTQ_KINDS, _gptq("gptq_v2")),
    "compressed-int4": _int4(
        ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "bias"),
        lambda t, c: int4_from_compressed_tensors(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"))),
    "fp8": _fp8(("weight", "weight_scale"), lambda t, c: fp8_from_checkpoint(t["weight"], t["weight_scale"])),
    "fp8-block": _fp8(("weight", "weight_scale", "weight_scale_inv"), fp8_blocks_from_checkpoint),
    "compressed-int8": _fp8(("weight", "weight_packed", "weight_shape", "weight_scale"), int8_from_compressed_tensors),
}
"""ModelConfig.packed_weights -> its format."""


class PrequantizedLoader:
    """Collects a checkpoint's quantized projections and installs our fused QuantizedLinears."""

    def __init__(self, packed_modules: Mapping[str, tuple[str, ...]], config: ModelConfig):
        assert config.packed_weights is not None
        self.packed_modules = packed_modules
        self.projections = {part for parts in packed_modules.values() for part in parts}
        self.format = FORMATS[config.packed_weights]
        self.name = config.packed_weights
        self.config = config
        self.parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def accepts(self, module: str, kind: str) -> bool:
        return module in self.projections and kind in self.format.kinds

    def add(self, layer: int, module: str, kind: str, tensor: torch.Tensor) -> None:
        self.parts.setdefault((layer, module), {})[kind] = tensor

    def accepts_expert(self, kind: str) -> bool:
        return kind in self.format.kinds and kind != "bias"  # biases are the layer's own (load_expert)

    def add_expert(self, layer: int, expert: int, projection: str, kind: str, tensor: torch.Tensor) -> None:
        self.parts.setdefault((layer, f"experts.{expert}.{projection}"), {})[kind] = tensor

    def install(self, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> None:
        for index, layer in enumerate(model.decoder_layers):
            for target, names in model.linears_of(layer).items():
                weight = self._read(index, target, names)
                tensors = [self.parts.pop((index, n)) for n in names]
                biases = [t["bias"] for t in tensors if t.get("bias") is not None]
                bias = torch.cat(biases).to(device, dtype) if len(biases) == len(tensors) else None
                layer.set_submodule(target, QuantizedLinear(weight.to(device), bias, self.format.kernel))
            if isinstance(layer.mlp, SparseMoeBlock):
                self._install_experts(index, layer.mlp, device)

    def _read(self, index: int, target: str, names: tuple[str, ...]) -> Any:
        """Layer `index`'s `target` in our layout: its parts (`names`) read and fused."""
        missing = [n for n in names if (index, n) not in self.parts]
        if missing:
            raise ConfigError("model", f"checkpoint lacks the quantized weights of layer {index}'s {missing} "
                                       f"({self.name}: a checkpoint that leaves decoder projections unquantized "
                                       "is not supported)")
        try:
            return self.format.concat([self.format.read(self.parts[(index, n)], self.config) for n in names])
        except (KeyError, ValueError) as error:
            raise ConfigError("model", f"layer {index}'s {target} ({self.name}): {error}") from None

    def _install_experts(self, index: int, block: SparseMoeBlock, device: torch.device) -> None:
        """Layer `index`'s experts, each read and its gate / up fused, stacked into `block`."""
        gate, up, down = (f"experts.{{}}.{p}" for p in EXPERT_PROJECTIONS)
        w13 = [self._read(index, f"mlp.experts.{e}", (gate.format(e), up.format(e))).to(device)
               for e in range(block.num_experts)]
        w2 = [self._read(index, f"mlp.experts.{e}", (down.format(e),)).to(device) for e in range(block.num_experts)]
        for e in range(block.num_experts):
            for name in (gate, up, down):
                del self.parts[(index, name.format(e))]
        try:
            block.install(stack_experts(w13, w2))
        except ValueError as error:
            raise ConfigError("model", f"layer {index}'s experts ({self.name}): {error}") from None
