"""The decoder layers of a Llama-family model as one C call per step (kernels/cpu/decoder_stack.py).

Why a module of its own: models/llama.py says what the model computes; this says when a step may skip
the Python around its kernels (the usual CPU steps: bf16 weights in pairs or float32 GGUF
blocks, a KV cache of that dtype, the C attention) and hands the C loop the model's tensors.
The result is the Python layers' to the bit; `forward` returns None wherever it does not apply
and the model runs its layers itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from pagedserve.kernels.cpu import decoder_stack as decoder_stack_cpu
from pagedserve.kernels.cpu.cache_write import write_kv_cache_cpu
from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_cpu_batch_invariant, step_plan

from ..attention import AttentionKernels, AttentionMetadata, LayerKVCache
from ..model_config import ModelConfig
from .linear_methods import Blocks, FewRowBlocks, Pairs, few_rows_of

if TYPE_CHECKING:
    from ..models.llama import LlamaForCausalLM, LlamaMLP, RMSNorm


class LlamaCStack:
    """One model's C layers, built on first use for the KV caches a step passes: the model's
    `fused_layers` on CPU (`attach`)."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.enabled = True
        """False keeps every step's layers in Python (tests compare the two)."""
        self._built: tuple[list[LayerKVCache], decoder_stack_cpu.DecoderStack | None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata, kernels: AttentionKernels,
                output_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final norm's output for the step (for the rows `output_rows` names, ascending, where
        given), or None where the C loop does not apply."""
        invariant = kernels.attend is paged_attention_cpu_batch_invariant  # `deterministic`: decode-only steps
        if (not self.enabled or input_ids.device.type != "cpu" or not (invariant or kernels.attend is paged_attention_cpu)
                or kernels.write_cache is not write_kv_cache_cpu or torch.compiler.is_compiling()):
            return None
        stack = self.stack(kv_caches)
        if stack is None:
            return None
        model = self.model
        window = model.config.layer_window(0)  # every layer's (computes_layers_of)
        plan = step_plan(meta.block_tables, meta.seq_lens, meta.query_start_loc, stack.block_size).windowed(window)
        if invariant and plan.prefills:  # its prompts run row by row as decodes, in Python (paged_attention_cpu)
            return None
        chunks, rest = plan.native_prefills(model.config.head_dim) if plan.prefills else (None, [])
        if rest:  # prompts longer than the C prefill takes, or cut by the window: SDPA, in Python
            return None
        h = model.embed(input_ids)
        cos, sin = model.rotary.tables(positions, h.dtype)
        few_block_rows = few_rows_of(model.decoder_layers[0].self_attn.qkv_proj.method)
        kept = None
        if output_rows is not None and output_rows.numel() < input_ids.shape[0]:
            if output_rows.numel() > 1 and not bool((output_rows[1:] > output_rows[:-1]).all()):
                return None  # the C loop keeps rows in order; the Python layers take any
            kept = decoder_stack_cpu.OutputRows(output_rows.to(torch.int64).contiguous(),
                                                output_rows.numel() <= few_block_rows)
        return stack.run(h, cos, sin, meta.slot_mapping, plan.decode, chunks, input_ids.shape[0] <= few_block_rows, kept)

    def stack(self, kv_caches: list[LayerKVCache]) -> decoder_stack_cpu.DecoderStack | None:
        """The C layers over these caches (None where they do not apply)."""
        if self._built is None or self._built[0] is not kv_caches:
            self._built = (kv_caches, self._build(kv_caches))
        return self._built[1]

    def _build(self, kv_caches: list[LayerKVCache]) -> decoder_stack_cpu.DecoderStack | None:
        model = self.model
        if not computes_layers_of(model.config):
            return None
        layers = []
        for layer, cache in zip(model.decoder_layers, kv_caches):
            attn, mlp = layer.self_attn, cast("LlamaMLP", layer.mlp)  # dense wherever computes_layers_of holds
            input_norm = cast("RMSNorm", layer.input_layernorm)  # one wherever computes_layers_of holds
            qkv, o, gate_up, down = (_linear_tensors(linear)
                                     for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            if (qkv is None or o is None or gate_up is None or down is None
                    or attn.o_proj.collectives is not None or mlp.down_proj.collectives is not None):
                return None  # quantized or otherwise laid out, or sharded
            layers.append(decoder_stack_cpu.LayerTensors(
                input_norm.weight, layer.post_attention_layernorm.weight, qkv, o, gate_up, down,
                cache.key, cache.value))  # a cache of another dtype (fp8) is declined by LayerTensors.weights
        first = model.decoder_layers[0]
        shape = decoder_stack_cpu.StackShape(
            model.local_config.hidden_size, first.self_attn.num_heads, first.self_attn.num_kv_heads,
            model.config.head_dim, cast("LlamaMLP", first.mlp).intermediate_size, model.config.rms_norm_eps,
            first.self_attn.scale)
        stack = decoder_stack_cpu.DecoderStack(layers, model.norm.weight, shape)
        return stack if stack.usable else None


def computes_layers_of(config: ModelConfig) -> bool:
    """Whether the C loop computes this model's layers: Llama's layer, whatever its rotary tables
    (rope scaling: `forward` passes the model's) and softmax scale (passed too, Granite's included),
    and with the embedding the model computes (Granite's multiplier). Not the variations of the
    layer itself, which it has no code for: query / key norms (Qwen3, OLMo 2), norms after the
    sublayers or OLMo 2's rounding, Granite's residual multiplier, partial rotary (Phi-4-mini),
    Gemma 3's norms around each sublayer, weight offsets, GELU and per-layer rotary tables; a
    sliding window only where every layer has it (Mistral: the step's plan is windowed once); no
    mixture of experts, no attention sinks."""
    return not (config.attention_sinks or config.qk_norm or config.sublayer_output_norms or config.norm_rounds_once
                or config.residual_multiplier != 1.0 or config.rotary_dim != config.head_dim
                or config.sandwich_norms or config.norm_weight_offset or config.activation != "silu"
                or 0 < len(config.sliding_layers) < config.num_layers or config.moe_layers)


def _linear_tensors(linear: Any) -> decoder_stack_cpu.LinearTensors | None:
    """bf16 layers' pairs (with the few-row GGUF blocks), float32 layers' GGUF blocks (their
    methods' forms); None for any other method or a quantized layer."""
    method = getattr(linear, "method", None)
    few = method if isinstance(method, FewRowBlocks) else None
    if few is not None:
        method = few.then
    if isinstance(method, Pairs):
        return decoder_stack_cpu.LinearTensors(method.pairs, None if few is None else few.blocks)
    if isinstance(method, Blocks) and few is None:
        return decoder_stack_cpu.LinearTensors(None, method.blocks, linear.bias)
    return None


def attach(model: LlamaForCausalLM) -> None:
    """Let the model's eager CPU steps run every layer in one C call where it applies."""
    model.fused_layers = LlamaCStack(model)
