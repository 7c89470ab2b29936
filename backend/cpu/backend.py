"""CpuBackend: the CPU backend's interface to an engine, chosen once at load (LLMEngine).

An engine on CPU asks it three things: to ready the process (glibc's heap, the C kernels
built before any request), which checkpoint values to keep while loading (a half-precision
layer's exact GGUF blocks, for its few-row matmuls), and to lay the loaded model out for its
kernels (each linear's method, the decoder layers as one C call). The engine holds one when
its device is the CPU and none otherwise, so no GPU engine reaches this package.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu
from pagedserve.kernels.cpu.native_build import build_all

from ..config import EngineConfig
from ..errors import ConfigError
from ..model_config import ModelConfig
from ..model_loader import CheckpointWeightHook
from ..models.llama import LlamaForCausalLM
from ..process_tuning import keep_freed_memory_in_heap
from .decoder_stack import attach
from .linear_methods import BATCH_INVARIANT_LAYOUTS, DEFAULT_LAYOUTS, WeightLayouts, keep_exact_blocks, pack_weights
from .matmul_probe import weight_layouts


class CpuBackend:
    """An engine's CPU-only steps at load, for its settings."""

    def __init__(self, config: EngineConfig):
        self.config = config
        keep_freed_memory_in_heap()
        build_all()  # every C kernel now (cached after install), so no request pays a compile

    def checkpoint_hook(self, dtype: torch.dtype, compiled: bool, tensor_parallel: bool) -> CheckpointWeightHook | None:
        """What the loader shows each linear's checkpoint weight to: `keep_exact_blocks`, which keeps a
        half-precision layer's GGUF blocks, for eager, unquantized, single-rank engines that may sum
        a few rows differently from many; None for the rest."""
        config = self.config
        keeps = (dtype in (torch.bfloat16, torch.float16) and not compiled and config.quantization == "none"
                 and not tensor_parallel and not config.deterministic)
        return keep_exact_blocks if keeps else None

    def prepare(self, model: LlamaForCausalLM, model_config: ModelConfig, dtype: torch.dtype,
                tensor_parallel: bool) -> None:
        """Lay an eager, unquantized model out for the CPU kernels: each linear's method, float32
        layouts measured (the batch-invariant ones with `deterministic`, the default ones with
        several ranks, whose shards all keep the same), and its layers as one C call."""
        config = self.config
        if config.deterministic and model_config.num_experts:
            raise ConfigError("deterministic", "has no batch-invariant CPU form for mixture-of-experts models (each "
                                               "expert multiplies the batch's rows for it); set deterministic=false")
        if config.deterministic and (model_config.attn_logit_softcapping or model_config.attention_sinks):
            raise ConfigError("deterministic", "has no batch-invariant CPU attention for soft-capped scores or "
                                               "attention sinks (Gemma 2, gpt-oss); set deterministic=false")
        if config.deterministic and dtype == torch.bfloat16 and bf16_matmul_cpu.LIBRARY.get() is None:
            raise ConfigError("deterministic", "needs the C bf16 matmul on CPU (oneDNN's bf16 kernels sum a row in "
                                               "another order at other row counts), and it is not available here (the "
                                               "log says why: no C compiler, a failed build, or PAGEDSERVE_NATIVE_CPU=0): "
                                               "install a C compiler (gcc, or set CC), unset PAGEDSERVE_NATIVE_CPU, or "
                                               "set dtype=float32")
        if config.deterministic:
            layouts = BATCH_INVARIANT_LAYOUTS
        elif tensor_parallel:
            layouts = DEFAULT_LAYOUTS
        else:
            layouts = weight_layouts(model_config, dtype, torch.device("cpu"), config.kv_cache_dtype == "fp8")
        prepare_rank(model, layouts)


def prepare_rank(model: nn.Module, layouts: WeightLayouts = DEFAULT_LAYOUTS) -> None:
    """Each linear's method as `layouts` says, and a Llama model's layers as one C call where they
    apply (a tensor-parallel rank's sharded layers never do; its linears are packed the same)."""
    pack_weights(model, layouts)
    if isinstance(model, LlamaForCausalLM):
        attach(model)
