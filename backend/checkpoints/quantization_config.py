"""A checkpoint's own quantization, from its config: which format its decoder projections are
stored in (checkpoints/prequantized.py reads them), or a refusal that names what is not served.

Read from config.json's `quantization_config` (AWQ, GPTQ, compressed-tensors, ModelOpt), or from
ModelOpt's `hf_quant_config.json` beside it.
"""

from __future__ import annotations

import re
from typing import Any

from pagedserve.kernels.fp8 import GROUP_MULTIPLE

from ..errors import ConfigError
from ..model_files import read_model_json

MODELOPT_FILE = "hf_quant_config.json"
SERVED = ("AWQ and GPTQ 4-bit, compressed-tensors FP8 (float-quantized, per tensor, channel or block), W4A16 and "
          "W8A16 (pack-quantized) and int8 W8A8 (int-quantized, run as W8A16), ModelOpt FP8, block-wise FP8 "
          "(weight_block_size), AutoFP8")


def checkpoint_quantization(path: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config, else ModelOpt's hf_quant_config.json as one (None: neither)."""
    if config.get("quantization_config"):
        return config["quantization_config"]
    spec = read_model_json(path, MODELOPT_FILE)
    if spec is None:
        return None
    return {"quant_method": "modelopt", **spec.get("quantization", spec)}


def prequantized(spec: dict[str, Any] | None) -> dict[str, Any]:
    """ModelConfig's packed_weights (and source_group_size or fp8_block) for a checkpoint's
    quantization, or a ConfigError naming what is not served."""
    if not spec:
        return {}
    method = str(spec.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return _awq_gptq(spec, method)
    if method == "compressed-tensors":
        return _compressed_tensors(spec)
    if method == "modelopt":
        algo = str(spec.get("quant_algo", "")).upper()
        if algo != "FP8":
            raise _refuse(f"ModelOpt {algo or 'unnamed'} checkpoints are not supported (FP8 is)")
        _only_head_excluded(spec.get("exclude_modules") or [], "exclude_modules")
        return {"packed_weights": "fp8"}
    if method == "fp8":
        return _fp8(spec)
    raise _refuse(f"checkpoint quantization {method!r} is not supported")


def _refuse(message: str) -> ConfigError:
    return ConfigError("model", f"{message}; served: {SERVED}")


def _awq_gptq(spec: dict[str, Any], method: str) -> dict[str, Any]:
    bits = spec.get("bits", spec.get("w_bit", 4))
    if bits != 4:
        raise _refuse(f"{method} checkpoints with {bits} bits are not supported (4 is)")
    if method == "awq" and str(spec.get("version", "gemm")).lower() != "gemm":
        raise _refuse("only GEMM-version AWQ checkpoints are supported")
    if method == "gptq" and spec.get("desc_act"):
        raise _refuse("act-order (desc_act) GPTQ checkpoints are not supported: their q/k/v cannot be fused")
    group = int(spec.get("group_size", spec.get("q_group_size", 128)))
    fmt = "awq" if method == "awq" else str(spec.get("checkpoint_format", "gptq")).lower()
    return {"packed_weights": fmt, "source_group_size": group}


def _fp8(spec: dict[str, Any]) -> dict[str, Any]:
    """quant_method "fp8": block-wise e4m3 weights with `weight_block_size` (DeepSeek-V3's and Qwen3's
    FP8 releases: a weight_scale_inv per block, activations quantized as they come), or without it
    AutoFP8's per-tensor weight_scale."""
    if str(spec.get("fmt", "e4m3")).lower() != "e4m3":
        raise _refuse(f"FP8 checkpoints in {spec['fmt']} are not supported (e4m3 is)")
    _only_head_excluded(list(spec.get("modules_to_not_convert") or spec.get("ignored_layers") or []),
                        "modules_to_not_convert")
    block = spec.get("weight_block_size")
    if not block:
        return {"packed_weights": "fp8"}
    return {"packed_weights": "fp8-block", "fp8_block": _block(block, "weight_block_size")}


def _block(block: Any, key: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(f"{key} {block!r} is not [rows, columns]")
    if block[1] % GROUP_MULTIPLE:
        raise _refuse(f"block-wise FP8 with {block[1]}-column blocks is not supported (a multiple of {GROUP_MULTIPLE} is)")
    return int(block[0]), int(block[1])


def _compressed_tensors(spec: dict[str, Any]) -> dict[str, Any]:
    """llm-compressor's schemes: FP8 (float-quantized, per tensor, channel or block; activations static
    or dynamic), W4A16 (pack-quantized, per group or channel, symmetric or not) and symmetric 8-bit
    integers (W8A16 pack-quantized, W8A8 int-quantized: run as W8A16), one scheme for every Linear,
    the LM head alone left out."""
    fmt = spec.get("format")
    if spec.get("sparsity_config"):
        raise _refuse("sparse compressed-tensors checkpoints are not supported")
    groups = list((spec.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors checkpoints with {len(groups)} schemes are not supported (one for every "
                      "Linear is)")
    weights = groups[0].get("weights") or {}
    _only_head_excluded(spec.get("ignore") or [], "ignore")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        if strategy == "block":
            return {"packed_weights": "fp8-block", "fp8_block": _block(weights.get("block_structure"), "block_structure")}
        if strategy not in ("tensor", "channel"):
            raise _refuse(f"compressed-tensors FP8 with {strategy!r} scales is not supported (tensor, channel and "
                          "block are)")
        return {"packed_weights": "fp8"}
    if fmt in ("pack-quantized", "int-quantized") and kind == "int" and bits == 8:
        if strategy not in ("group", "channel") or not weights.get("symmetric", True):
            raise _refuse(f"compressed-tensors 8-bit weights with strategy {strategy!r}, symmetric "
                          f"{weights.get('symmetric')!r} are not supported (symmetric group and channel scales are)")
        group = weights.get("group_size") if strategy == "group" else None
        if group is not None and group % GROUP_MULTIPLE:
            raise _refuse(f"compressed-tensors 8-bit weights in groups of {group} are not supported (a multiple of "
                          f"{GROUP_MULTIPLE} is)")
        return {"packed_weights": "compressed-int8", "source_group_size": group}
    if fmt == "pack-quantized" and kind == "int" and bits == 4:
        if strategy not in ("group", "channel") or weights.get("actorder") not in (None, False, "static"):
            raise _refuse(f"compressed-tensors W4A16 with strategy {strategy!r} / actorder {weights.get('actorder')!r} "
                          "is not supported (group and channel scales, no activation order are)")
        if groups[0].get("input_activations"):
            raise _refuse("compressed-tensors 4-bit weights with quantized activations are not supported (W4A16 is)")
        return {"packed_weights": "compressed-int4", "source_group_size": weights.get("group_size")}
    raise _refuse(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights is not supported")


_ROUTER = re.compile(r"(^|[.:*])(gate|router|shared_expert_gate)\$?$")
"""A mixture of experts' router (mlp.gate, block_sparse_moe.gate, gpt-oss's mlp.router; exact names or
`re:` patterns): MoE releases leave it unquantized and say so, and it is loaded as it is stored."""


def _only_head_excluded(names: list[str], key: str) -> None:
    others = [name for name in names if "lm_head" not in name and not _ROUTER.search(name)]
    if others:
        raise _refuse(f"checkpoints that leave decoder layers unquantized ({key} {others[:4]}) are not supported")
