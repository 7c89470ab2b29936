"""Where the engine runs: device, compute dtype, and how many KV blocks fit.

Decided once at start-up from EngineConfig; every choice that depends on the
machine (GPU memory left after the weights, native bf16 on this CPU) lives here.
"""

from __future__ import annotations

import torch

from .config import EngineConfig
from .errors import ConfigError
from .model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is visible; use device=cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 math (about 2x float32's
    speed there), float32 elsewhere."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False
    return torch.bfloat16 if native_bf16 else torch.float32


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, device: torch.device, kv_dtype: torch.dtype) -> int:
    """KV blocks for this engine: the exact count asked for, else what the budget holds
    (free GPU memory above the utilization cap, or kv_cache_bytes on CPU)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model_config, config.block_size, kv_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
    else:
        budget = config.kv_cache_bytes
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ConfigError("kv_cache_bytes", f"the KV budget holds no block of {per_block} bytes; raise it")
    return blocks


def max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> int:
    """The configured max_model_len, or the most the model and the KV cache allow."""
    context = model_config.max_position_embeddings
    if model_config.sliding_window:
        context = min(context, model_config.sliding_window)  # exact without a sliding-window kernel
    asked = config.max_model_len
    if asked > context:
        raise ConfigError("max_model_len", f"must be <= the model's context length {context}, got {asked}")
    capacity = num_blocks * config.block_size
    if asked > capacity:
        raise ConfigError(
            "max_model_len",
            f"{asked} tokens do not fit the KV cache ({num_blocks} blocks x "
            f"{config.block_size} = {capacity} tokens); raise the KV budget or lower max_model_len",
        )
    return asked or min(context, capacity)
