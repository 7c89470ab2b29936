"""ModelConfig: the architecture numbers the engine needs, whatever the checkpoint
format (checkpoints/hf.py and checkpoints/gguf.py fill it in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    """attention's output projection has a bias too (`attention_bias` in Llama, Qwen3, Granite and
    OLMo 2 configs; Qwen2's bias is on q/k/v only)."""
    qk_norm: bool = False
    """Each query and key head RMS-normed before rotary (Qwen3)."""
    qk_norm_across_heads: bool = False
    """With qk_norm: one RMSNorm over the whole q_proj (k_proj) output, every head together, with
    a weight as wide (OLMo 2), where Qwen3 norms each head over head_dim with one shared weight."""
    sublayer_output_norms: bool = False
    """OLMo 2's layer: attention and MLP read the residual stream itself (no input norms) and their
    outputs are RMS-normed (post_attention_layernorm, post_feedforward_layernorm) before each is
    added to it; Llama norms each sublayer's input instead."""
    norm_rounds_once: bool = False
    """RMSNorm multiplies the float32 normed row by its weight, then rounds to the model dtype
    (OLMo 2); Llama's rounds the normed row first and multiplies in the model dtype. The same in
    float32, apart in bf16 / fp16, where following the checkpoint's own order keeps it exact."""
    sandwich_norms: bool = False
    """Gemma 3's layer: each sublayer's input and output RMS-normed (input_layernorm and
    post_attention_layernorm around attention, pre_ and post_feedforward_layernorm around the MLP)."""
    norm_weight_offset: float = 0.0
    """Gemma: every RMSNorm multiplies by (offset + weight) in float32 (its weights are stored
    centred on zero); with norm_rounds_once."""
    activation: str = "silu"
    """The MLP's gate activation: "silu" (Llama), "gelu_tanh" (Gemma's gelu_pytorch_tanh)."""
    local_rope_theta: float | None = None
    """Gemma 3: the rotary base of the sliding-window layers (`sliding_layers`), which take no rope
    scaling; the others turn by rope_theta with rope_scaling."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: attention scores become cap * tanh(score / cap) before the softmax."""
    final_logit_softcapping: float | None = None
    """Gemma: logits = cap * tanh(logits / cap), in the model dtype, before anything reads them."""
    embedding_multiplier: float = 1.0
    """Granite: the token embeddings are multiplied by this before the first layer."""
    embedding_multiplier_rounds: bool = False
    """The multiplier is rounded to the model dtype before it multiplies (Gemma's sqrt(hidden_size));
    Granite's multiplies as the exact float."""
    residual_multiplier: float = 1.0
    """Granite: each sublayer's output is multiplied by this before its residual add."""
    attention_multiplier: float | None = None
    """Granite: the attention softmax scale, which Granite trains with in place of 1/sqrt(head_dim)
    (None: 1/sqrt(head_dim))."""
    logits_scaling: float = 1.0
    """Granite: the LM head's logits are divided by this (so temperatures and log-probabilities
    see the distribution the model was trained to give)."""
    rope_scaling: dict[str, Any] | None = None
    """The checkpoint's rope scaling parameters (rope_type linear, dynamic, yarn, llama3, longrope;
    see models/rope.py's rope_frequencies); None for plain rotary."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dimensions that rotary turns (the first ones; Phi-4-mini: 0.75)."""
    sliding_window: int | None = None
    """The keys a sliding-window layer's query sees, its own included (the last this many positions)."""
    sliding_layers: tuple[int, ...] = ()
    """The layers that attend within sliding_window: every one (Mistral), those from max_window_layers
    on (Qwen2 with use_sliding_window), five of every six (Gemma 3); the others attend to the whole context."""
    num_experts: int = 0
    """Mixture of experts: the experts of each MoE layer (Mixtral, Qwen3-MoE); 0 for dense MLPs."""
    experts_per_token: int = 0
    """The experts each token is routed to (top-k of the router's softmax)."""
    expert_intermediate_size: int = 0
    """Each expert's MLP width (Qwen3-MoE's moe_intermediate_size; Mixtral's intermediate_size)."""
    moe_layers: tuple[int, ...] = ()
    """The layers whose MLP is the experts (Mixtral: all; Qwen3-MoE: by decoder_sparse_step, less
    mlp_only_layers); the others keep a dense MLP of intermediate_size."""
    renormalize_expert_weights: bool = True
    """The top-k routing weights are divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)."""
    expert_weights_rounded: bool = False
    """The routing weights are rounded to the model dtype before they scale the experts' outputs
    (Qwen3-MoE); Mixtral's scale them in float32."""
    softmax_after_topk: bool = False
    """gpt-oss: the routing weights are the softmax of the top-k router logits, in the logits' dtype,
    where Mixtral and Qwen3-MoE take the top k of the float32 softmax."""
    router_bias: bool = False
    """The router's linear has a bias (gpt-oss)."""
    expert_bias: bool = False
    """Each expert's gate / up and down projections have biases (gpt-oss)."""
    clamped_swiglu: tuple[float, float] | None = None
    """gpt-oss's expert activation, (alpha, limit): gate clamped above at limit, up to +-limit, then
    (up + 1) * gate * sigmoid(alpha * gate); None for Llama's silu(gate) * up."""
    attention_sinks: bool = False
    """gpt-oss: each attention head has a learned sink logit (`self_attn.sinks`) that joins its
    softmax's denominator with no value."""
    mxfp4_experts: bool = False
    """The experts come as MXFP4 codes and scales (gpt-oss's release) and are held so (kernels/mxfp4.py)."""
    eos_token_ids: list[int] = field(default_factory=list)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    """The sampling fields generation_config.json sets away from transformers' defaults (temperature,
    top_p, top_k, min_p, repetition_penalty: vLLM's `get_diff_sampling_param`), or the bundled model's
    card's (model_files.DEFAULT_SAMPLING): what a request that asks for the model's defaults
    (`use_model_defaults`: the CLI's, LLMClient's, the OpenAI gateway's) gets where it is silent."""
    bos_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    mrope_section: tuple[int, ...] | None = None
    """Multimodal rotary positions (Qwen2.5-VL): how many of each head's rotary frequencies turn by an
    image token's time, height and width position; text tokens turn alike in all three."""
    vision_language: str | None = None
    """The vision-language family (backend/multimodal/) whose language model this is; None: a text model."""
    source_group_size: int | None = None
    """Block size of the checkpoint's own weight quantization (GGUF Q4_1: 32), if any."""
    source_block_format: str | None = None
    """"q4_1" or "q8_0" when the checkpoint's layer weights are GGUF blocks of that format, which
    float32 engines multiply through (kernels/cpu/block_matmul.py): dtype auto times those."""
    packed_weights: str | None = None
    """The format of the checkpoint's quantized decoder projections (checkpoints/prequantized.py's
    FORMATS: "awq", "gptq", "gptq_v2", "compressed-int4", "fp8", "fp8-block"), None where they are not."""
    fp8_block: tuple[int, int] | None = None
    """(rows, columns) of a block-wise FP8 checkpoint's scale tiles (its weight_block_size)."""

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions rotary turns (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window, None where it attends to the whole context."""
        return self.sliding_window if index in self.sliding_layers else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

