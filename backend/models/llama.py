"""Llama-family decoder (Llama 2/3, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, SmolLM, Granite, OLMo 2, Phi-3,
Gemma 2 / 3, gpt-oss) in plain torch over a flat batch.

Every token of every sequence in the step is one row; attention is the only
place sequences meet, through the paged KV cache. q/k/v and gate/up are fused
into single matmuls; numerics otherwise follow Hugging Face's implementation. The other
families are variations of Llama's layer, each switched on by its ModelConfig fields: Qwen3's
per-head query / key norms, Granite's multipliers, OLMo 2's norms after each sublayer, Phi-3's
partial rotary, Gemma 3's norms around each sublayer, GELU and per-layer rotary bases, sliding-window
layers, Gemma 2's soft-capped attention scores, gpt-oss's attention sinks, and the mixture-of-experts MLP
(models/moe.py) in place of the dense one.
Split over ranks (tensor parallelism), each rank builds its share of every layer
from models/parallel.py; with one rank those are the plain layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.dispatch import fused_add_rms_norm, fused_rms_norm, fused_rotary, fused_silu_mul, invariant_rms_norm

from ..attention import AttentionKernels, AttentionMetadata, LayerKVCache, attention
from ..model_config import ModelConfig
from .moe import SparseMoeBlock
from .parallel import (
    SINGLE_RANK,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)
from .rope import rope_frequencies

if TYPE_CHECKING:
    from ..multimodal.step_embeddings import EmbeddingPatch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, rounds_once: bool = False, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.rounds_once = rounds_once
        """ModelConfig.norm_rounds_once: the weight multiplies the float32 row (OLMo 2's order)."""
        self.offset = offset
        """ModelConfig.norm_weight_offset: (offset + weight) multiplies, in float32 (Gemma)."""
        self.batch_invariant = False
        """`deterministic` on a GPU (backend/batch_invariant.py): one row a program, whatever the batch."""

    @classmethod
    def of(cls, config: ModelConfig, size: int) -> RMSNorm:
        """A norm of `size` as the model's family computes it."""
        return cls(size, config.rms_norm_eps, config.norm_rounds_once, config.norm_weight_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm; on CPU one C pass (kernels/cpu/rms_norm.py) where it is built
        and rounds as this norm does (Llama's order, or any order in float32)."""
        if self.batch_invariant:
            return invariant_rms_norm(x, self.weight, self.eps, self.rounds_once, self.offset)
        fused = fused_rms_norm(x, self.weight, self.eps) if self._c_rounds_alike(x) else None
        if fused is not None:
            return fused
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        if self.rounds_once:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding delta, and its norm (on CPU one C pass)."""
        c_pass = self._c_rounds_alike(h) and not self.batch_invariant
        fused = fused_add_rms_norm(h, delta, self.weight, self.eps) if c_pass else None
        if fused is not None:
            return fused
        h = h + delta
        return h, self(h)

    def _c_rounds_alike(self, x: torch.Tensor) -> bool:
        """The C kernels round the normed row before the weight, as Llama does; in float32 that
        rounding is none, so they give OLMo 2's order too. They take no weight offset."""
        return not self.offset and (not self.rounds_once or x.dtype == torch.float32)


class ReadsResidual(nn.Module):
    """In place of a layer's input norm where its attention reads the residual stream itself
    (OLMo 2, which norms the sublayers' outputs instead): RMSNorm's interface, no norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + delta
        return h, h


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32 as HF does."""

    cos: torch.Tensor  # buffers (register_buffer), declared for the type checker
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.local = (RotaryEmbedding(dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None,
                                                          sliding_layers=()), max_positions)
                      if config.sliding_layers and config.local_rope_theta is not None else None)
        """Gemma 3's sliding-window layers' tables (their own base, no scaling); None elsewhere."""
        inv_freq, attention_factor = rope_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:  # YaRN's: transformers scales cos and sin, in float32, as here
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.mrope_section = config.mrope_section
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated by each token's position (q and k of a layer
        go through together: they sit side by side in the fused projection's output)."""
        cos, sin = self.tables(positions, x.dtype)
        turned = cos.shape[-1]
        if turned < x.shape[-1]:  # partial rotary: the first dimensions turn, the rest pass as they are
            part = x[..., :turned]
            return torch.cat((part * cos + _rotate_half(part) * sin, x[..., turned:]), dim=-1)
        fused = fused_rotary(x, cos, sin)
        if fused is not None:
            return fused
        return x * cos + _rotate_half(x) * sin

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [tokens, 1, rotary_dim] in `dtype`. Every layer of a step asks for
        the same positions tensor, so the last pair is kept (eager only: the compiled step
        takes no Python state into its graph)."""
        if torch.compiler.is_compiling():
            return self._lookup(positions, dtype)
        last = self._last
        if last is None or last[0] is not positions or last[1] != dtype:
            last = self._last = (positions, dtype, *self._lookup(positions, dtype))
        return last[2], last[3]

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def prime(self, positions: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor, rows_3d: torch.Tensor) -> None:
        """The step's tables (`tables` returns them for `positions`) with `rows` turned by multimodal
        rotary positions rows_3d [3, k]: each frequency by the time, height or width position its
        mrope_section assigns it, as transformers' apply_multimodal_rotary_pos_emb does."""
        sections = self.mrope_section
        assert sections is not None, "multimodal rotary positions on a model without mrope_section"
        cos, sin = self._lookup(positions, dtype)
        which = torch.repeat_interleave(torch.arange(3, device=rows_3d.device), torch.tensor(sections, device=rows_3d.device))
        which = torch.cat((which, which))  # the two halves rotate_half pairs
        picked = [(self.cos[rows_3d[axis]], self.sin[rows_3d[axis]]) for axis in range(3)]
        dims = torch.arange(which.numel(), device=rows_3d.device)
        cos_rows = torch.stack([c for c, _ in picked])[which, :, dims].T.to(dtype)
        sin_rows = torch.stack([s for _, s in picked])[which, :, dims].T.to(dtype)
        cos, sin = cos.clone(), sin.clone()
        cos[rows, 0], sin[rows, 0] = cos_rows, sin_rows
        self._last = (positions, dtype, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them with one rank)."""

    def __init__(self, config: ModelConfig, parallel: TensorParallel, index: int = 0):
        super().__init__()
        local = parallel.local_config(config)
        self.window = config.layer_window(index)
        """The keys each query sees (a sliding-window layer's), None for the whole context. A
        sliding-window layer turns by the model's local rotary tables where it has them (Gemma 3)."""
        self.num_heads = local.num_heads
        self.num_kv_heads = local.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = local.q_size, local.kv_size
        kv_shard = parallel.kv_shard(config.num_kv_heads)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, (parallel.shard(0), kv_shard, kv_shard), bias=config.qkv_bias
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, parallel, bias=config.o_bias)
        self.scale = self.head_dim**-0.5 if config.attention_multiplier is None else config.attention_multiplier
        """The softmax scale, which every attention kernel takes as an argument."""
        self.softcap = config.attn_logit_softcapping
        """Gemma 2: scores become softcap * tanh(score / softcap) before the softmax; None for none."""
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        """gpt-oss: each query head's sink logit, one more term of its softmax's denominator; None for none."""
        self.shards = (parallel.shard(0),)
        """This rank's query heads' share of the one tensor held here itself (the sinks)."""
        # queries and keys RMS-normed before rotary: each head over head_dim with one weight (Qwen3),
        # or the whole projection with a weight as wide (OLMo 2)
        q_width, k_width = (self.q_size, self.kv_size) if config.qk_norm_across_heads else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm.of(config, q_width) if config.qk_norm else None
        self.k_norm = RMSNorm.of(config, k_width) if config.qk_norm else None

    def project(
        self, x: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of every token, rotated: what the paged attention reads."""
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            qk = torch.cat((self._normed(self.q_norm, q), self._normed(self.k_norm, k)), dim=-1)
        if self.window is not None and rotary.local is not None:
            rotary = rotary.local
        qk = rotary(positions, qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    @staticmethod
    def _normed(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, width] normed over the norm's own width: each head's head_dim, or all of it."""
        return norm(x.reshape(-1, norm.weight.shape[0])).view(x.shape)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel):
        super().__init__()
        self.intermediate_size = parallel.local_config(config).intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, 2 * self.intermediate_size, (parallel.shard(0), parallel.shard(0))
        )
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, parallel)
        if config.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {config.activation!r} is not supported (silu, gelu_tanh are)")
        self.gelu = config.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:  # Gemma's gelu_pytorch_tanh
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        activated = fused_silu_mul(gate_up)  # one C pass on CPU (float32, bfloat16) where it is built
        if activated is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            activated = F.silu(gate).mul_(up)  # in place: one [rows, intermediate] pass and buffer fewer
        return self.down_proj(activated)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel, index: int = 0):
        super().__init__()
        def norm() -> RMSNorm:
            return RMSNorm.of(config, config.hidden_size)

        sandwich = config.sandwich_norms
        output_norms = config.sublayer_output_norms or sandwich
        self.input_layernorm: RMSNorm | ReadsResidual = ReadsResidual() if config.sublayer_output_norms else norm()
        self.self_attn = LlamaAttention(config, parallel, index)
        self.post_attention_layernorm = norm()
        """Llama: the MLP's input norm; OLMo 2, Gemma 3: the attention output's norm (the checkpoints' name for each)."""
        self.pre_feedforward_layernorm = norm() if sandwich else None
        """Gemma 3: the MLP's input norm."""
        self.post_feedforward_layernorm = norm() if output_norms else None
        self.mlp: LlamaMLP | SparseMoeBlock = (SparseMoeBlock(config, parallel) if index in config.moe_layers
                                               else LlamaMLP(config, parallel))
        self.residual_multiplier = config.residual_multiplier

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention: output projection and its residual, then the MLP.
        Returns the residual stream and the MLP's output, which the next norm adds to it
        (`RMSNorm.add_and_norm`: the add and the norm in one pass)."""
        out = self.self_attn.o_proj(attn.reshape(h.shape[0], -1))
        if self.post_feedforward_layernorm is None:
            h, x = self.post_attention_layernorm.add_and_norm(h, self._scaled(out))
            return h, self._scaled(self.mlp(x))
        h = h + self._scaled(self.post_attention_layernorm(out))
        x = h if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(h)
        return h, self._scaled(self.post_feedforward_layernorm(self.mlp(x)))

    def _scaled(self, delta: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as added to the residual stream (Granite multiplies it)."""
        return delta if self.residual_multiplier == 1.0 else delta * self.residual_multiplier


class FusedLayers(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata, kernels: AttentionKernels,
                output_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final norm's output for the step (for `output_rows` alone, where given), or None
        where it does not apply (the model runs its layers itself)."""
        ...


class LlamaForCausalLM(nn.Module):
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",),
    }
    """Each decoder layer's linear layers, with the checkpoint (Hugging Face) projections
    stacked, in this order, along their output rows. Weight loading, quantize-on-load
    and packed 4-bit checkpoints all follow this one table (`linears_of`: a layer's share)."""

    def __init__(self, config: ModelConfig, max_positions: int, parallel: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.local_config = local = parallel.local_config(config)
        """This rank's share of the architecture (`config` itself with one rank): its KV cache is sized from it."""
        self.embed_tokens = VocabParallelEmbedding(local.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, parallel, i) for i in range(config.num_layers))
        self.norm = RMSNorm.of(config, config.hidden_size)
        self.lm_head = ParallelLMHead(config.hidden_size, local.vocab_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_positions)
        self.fused_layers: FusedLayers | None = None
        """Runs every layer of an eager step at once where it applies (the CPU backend's C loop,
        backend/cpu/decoder_stack.py, attached at load); None: the layers below, one by one."""
        self.aux_layers: tuple[int, ...] = ()
        """Layers whose input residual stream a step keeps, in `aux_hidden` (an EAGLE-3 head reads
        them: backend/spec_decode/eagle3.py); the layers then run one by one."""
        self.aux_hidden: torch.Tensor | None = None
        """The last forward's states of `aux_layers`, side by side: [rows, len(aux_layers) x hidden]."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        kernels: AttentionKernels,
        pieces: ForwardPieces | None = None,
        output_rows: torch.Tensor | None = None,
        patch: EmbeddingPatch | None = None,
    ) -> torch.Tensor:
        """Hidden states of every input token, [num_tokens, hidden], or of the rows
        `output_rows` names (ascending, distinct: the rows a step samples).

        The layers run as pieces between their attentions (`ForwardPieces`), so that the
        compiled step (backend/compiled_forward.py) can swap in compiled pieces while the
        paged attention, whose layout changes every step, stays eager. Eagerly, the last
        layer's work past its attention runs for `output_rows` alone: a prompt chunk's other
        rows feed no later layer (~3% of a 30-layer prefill's arithmetic)."""
        if pieces is None and self.fused_layers is not None and not self.aux_layers:
            hidden = self.fused_layers.forward(input_ids, positions, kv_caches, meta, kernels, output_rows)
            if hidden is not None:
                return hidden
        eager, pieces = pieces is None, pieces or EAGER_PIECES
        if patch is None:
            h, q, k, v = pieces.first(self, input_ids, positions)
        else:
            h, q, k, v = first_piece(self, input_ids, positions, patch)
        last = len(self.layers) - 1
        kept: list[torch.Tensor] = []
        for i, (layer, kv_cache) in enumerate(zip(self.decoder_layers, kv_caches)):
            if i in self.aux_layers:
                kept += [h] * self.aux_layers.count(i)
                if len(kept) == len(self.aux_layers):
                    self.aux_hidden = torch.cat(kept, dim=-1)
            attn = attention(kernels, q, k, v, kv_cache, meta, layer.self_attn.scale, layer.self_attn.window,
                             layer.self_attn.softcap, layer.self_attn.sinks)
            if i == last:
                if output_rows is None or output_rows.numel() == h.shape[0]:
                    return pieces.last(self, layer, h, attn)
                if not eager:  # compiled pieces keep the shapes they were compiled for
                    return pieces.last(self, layer, h, attn)[output_rows]
                if output_rows.numel() == 0:
                    return h.new_empty((0, h.shape[1]))
                return pieces.last(self, layer, h[output_rows], attn[output_rows])
            h, q, k, v = pieces.middle(self, layer, self.layers[i + 1], h, attn, positions)
        raise ValueError("a model without layers")

    def linears_of(self, layer: LlamaDecoderLayer) -> dict[str, tuple[str, ...]]:
        """The `packed_modules` entries `layer` holds as linear layers: all but the MLP's where its MLP
        is a mixture of experts (stacked experts, no dense projections)."""
        if isinstance(layer.mlp, SparseMoeBlock):
            return {name: parts for name, parts in self.packed_modules.items() if not name.startswith("mlp.")}
        return self.packed_modules

    @property
    def decoder_layers(self) -> Sequence[LlamaDecoderLayer]:
        """`layers` as what it holds, for the type checker (an nn.ModuleList's items are typed Module)."""
        return cast("Sequence[LlamaDecoderLayer]", self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings as the first layer reads them (Granite and Gemma multiply them)."""
        h = self.embed_tokens(input_ids)
        multiplier = self.config.embedding_multiplier
        if multiplier == 1.0:
            return h
        return h * torch.tensor(multiplier, dtype=h.dtype) if self.config.embedding_multiplier_rounds else h * multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; Granite's divided by its logits_scaling and Gemma's soft-capped, in the model
        dtype, as transformers does."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


Residual = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""h (the residual stream) and the next layer's q, k, v."""


def first_piece(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                patch: EmbeddingPatch | None = None) -> Residual:
    """Embedding (with `patch`'s rows given: images'), then the first layer up to its attention."""
    h = model.embed(input_ids)
    if patch is not None:
        h = h.index_copy(0, patch.rows, patch.values.to(h.dtype))
        if patch.rope_positions is not None:  # every layer of the step turns the image rows by theirs
            model.rotary.prime(positions, h.dtype, patch.rows, patch.rope_positions)
    first: LlamaDecoderLayer = model.layers[0]  # type: ignore[assignment]  # a ModuleList's items are typed Module
    return (h, *first.self_attn.project(first.input_layernorm(h), model.rotary, positions))


def middle_piece(
    model: LlamaForCausalLM,
    layer: LlamaDecoderLayer,
    following: LlamaDecoderLayer,
    h: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
) -> Residual:
    """One layer after its attention, then the following layer up to its attention."""
    h, x = following.input_layernorm.add_and_norm(*layer.finish(h, attn))
    return (h, *following.self_attn.project(x, model.rotary, positions))


def last_piece(model: LlamaForCausalLM, layer: LlamaDecoderLayer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The last layer after its attention, then the final norm."""
    return model.norm.add_and_norm(*layer.finish(h, attn))[1]


@dataclass(frozen=True)
class ForwardPieces:
    """The model's work between attentions, as three functions: the same for every
    layer, so a compiler builds each once (the layers are arguments, not constants)."""

    first: Callable[..., Residual] = first_piece
    middle: Callable[..., Residual] = middle_piece
    last: Callable[..., torch.Tensor] = last_piece


EAGER_PIECES = ForwardPieces()
