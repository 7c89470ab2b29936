"""gpt-oss checkpoints: its config's numbers, and its tensors renamed and reshaped into the layout the
loader reads for every mixture of experts.

gpt-oss stores each layer's experts stacked and transposed (`mlp.experts.gate_up_proj` [experts,
hidden, 2 * inter] with gate and up interleaved in its columns, `down_proj` [experts, inter, hidden],
their biases [experts, 2 * inter] / [experts, hidden]), and OpenAI's release stores those weights in
MXFP4 (`*_blocks`: two e2m1 values a byte, 32 a block; `*_scales`: one e8m0 power of two a block).
They become the per-expert tensors Mixtral and Qwen3-MoE checkpoints have (experts.E.gate_proj /
up_proj / down_proj, .weight and .bias); MXFP4 weights stay MXFP4, each expert's codes and scales
as `.weight_blocks` [out, in / 2] and `.weight_scales` [out, in / 32] (kernels/mxfp4.py's layout),
run so by the fused MoE kernels. The router (`mlp.router`) is the MoE block's `gate`.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from pagedserve.kernels.mxfp4 import check_blocks

from ..errors import ConfigError

_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def gpt_oss_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts and attention-sink fields of a gpt-oss config.json."""
    quantization = config.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise ConfigError("model", f"gpt-oss checkpoints quantized with {quantization.get('quant_method')!r} are not "
                                   "supported (its own MXFP4 release and bf16 checkpoints are)")
    return dict(num_experts=config.get("num_local_experts", 128), experts_per_token=config.get("num_experts_per_tok", 4),
                expert_intermediate_size=config["intermediate_size"],
                moe_layers=tuple(range(config["num_hidden_layers"])), softmax_after_topk=True, router_bias=True,
                expert_bias=True, attention_sinks=True, mxfp4_experts=bool(quantization),
                clamped_swiglu=(float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))))


def gpt_oss_tensors(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with its router and stacked experts as the loader reads them (see the
    module docstring)."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        match = _EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, projection, suffix = match.groups()
        if suffix == "_bias":
            yield from _per_expert(prefix, projection, "bias", tensor)
        elif suffix is None:  # stored [experts, in, out] (the bf16 checkpoints transformers writes)
            yield from _per_expert(prefix, projection, "weight", tensor.transpose(1, 2))
        else:  # MXFP4: [experts, out, in / 32, 16] blocks and [experts, out, in / 32] scales, in either order
            parts = pending.setdefault((prefix, projection), {})
            parts[suffix] = tensor
            if len(parts) == 2:
                del pending[(prefix, projection)]
                blocks, scales = parts["_blocks"], parts["_scales"]
                try:
                    check_blocks(blocks, scales)
                except ValueError as error:
                    raise ConfigError("model", f"{prefix}.{projection}: {error}") from None
                yield from _per_expert(prefix, projection, "weight_blocks", blocks.flatten(-2))
                yield from _per_expert(prefix, projection, "weight_scales", scales)
    if pending:
        unpaired = [f"{prefix}.{projection}{next(iter(parts))}" for (prefix, projection), parts in pending.items()]
        raise ConfigError("model", f"MXFP4 tensors without their blocks or scales: {unpaired[:4]}")


def _per_expert(prefix: str, projection: str, kind: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert's gate / up (rows 0, 2, 4, ... and 1, 3, 5, ... of gate_up: interleaved) or down
    tensor; `stacked` is [experts, out, ...] (bias, weight, MXFP4 codes or scales)."""
    for expert, tensor in enumerate(stacked):
        if projection == "down_proj":
            yield f"{prefix}.{expert}.down_proj.{kind}", tensor
        else:
            yield f"{prefix}.{expert}.gate_proj.{kind}", tensor[0::2]
            yield f"{prefix}.{expert}.up_proj.{kind}", tensor[1::2]
