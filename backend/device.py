"""Where the engine runs: device, compute dtype, and how many KV blocks fit.

Decided once at start-up from EngineConfig; every choice that depends on the
machine (GPU memory left after the weights, the fastest dtype on this CPU) lives here.
"""

from __future__ import annotations

import logging

import torch

from .config import EngineConfig
from .errors import ConfigError
from .model_config import ModelConfig

logger = logging.getLogger("pagedserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is visible; use device=cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_config: ModelConfig) -> torch.dtype:
    """auto: bfloat16 on CUDA; on CPU, float32 unless the CPU has native bf16 math and
    bf16 then measures faster on the model's own matmul shape; the log says which and why.

    oneDNN reports bf16 as supported on any AVX-512 CPU, emulating it there at about
    half of float32's speed, so native support is read from the CPU flags first. The
    flags alone do not settle it (backend/cpu/matmul_probe.py): with avx512_bf16 and no
    AMX, bf16 lost to float32 at batch sizes on a Xeon and won by far on an AMD EPYC
    (benchmarks/RESULTS.md, "Xeon (no AMX): bf16 and float32 matmuls" and "fp8 KV cache
    perplexity and the CPU float32 layouts")."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        logger.info("dtype auto: bfloat16 (CUDA)")
        return torch.bfloat16
    flags = native_bf16_flags(cpuinfo())
    if not flags:
        logger.info("dtype auto: float32 (no native bf16 math on this CPU: no avx512_bf16, amx_bf16 or Arm bf16 "
                    "flag; bf16 would be emulated, slower than float32)")
        return torch.float32
    from .cpu.matmul_probe import matmul_times  # the CPU backend's, on CPU only

    times = matmul_times(model_config)
    chosen = torch.bfloat16 if times.bfloat16 < times.float32 else torch.float32
    logger.info("dtype auto: %s (this CPU has %s; measured %s; set dtype to override)",
                str(chosen).removeprefix("torch."), " ".join(flags), times.summary())
    return chosen


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16 and AMX; Arm's FEAT_BF16 ("bf16")


def native_bf16_flags(cpuinfo: str) -> list[str]:
    """The CPU flags (of /proc/cpuinfo's text) that mean native bf16 dot products."""
    present: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present |= set(value.split())
    return [flag for flag in NATIVE_BF16_FLAGS if flag in present]


def cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux: no flags to read, so float32
        return ""


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, device: torch.device, kv_dtype: torch.dtype,
                  draft_block_bytes: int = 0) -> int:
    """KV blocks for this engine: the exact count asked for, else what the budget holds
    (free GPU memory above the utilization cap, or kv_cache_bytes on CPU); a draft model's
    cache has a block for each of the target's, paid from the same budget."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model_config, config.block_size, kv_dtype) + draft_block_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # What torch's allocator holds for this process but no tensor uses (a released
        # engine's KV cache, say) is free to us, though the driver counts it as taken.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
    else:
        budget = config.kv_cache_bytes
    blocks = int(budget // per_block)
    if blocks < 1 and device.type == "cuda":
        raise ConfigError(
            "gpu_memory_utilization",
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free on {device}, under the "
            f"{1 - config.gpu_memory_utilization:.0%} kept back: no KV block of {per_block} bytes fits; raise "
            "gpu_memory_utilization, free the GPU (another engine or process holds it), or set num_kv_blocks",
        )
    if blocks < 1:
        raise ConfigError("kv_cache_bytes", f"the KV budget holds no block of {per_block} bytes; raise it")
    return blocks


def max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> int:
    """The configured max_model_len, or the most the model and the KV cache allow."""
    context = model_config.max_position_embeddings
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
