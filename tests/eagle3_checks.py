"""A random EAGLE-3 head in the published format, for the engine and served tests."""

from __future__ import annotations

import json
import os

import torch


def write_eagle3_head(directory: str, target: str, draft_vocab: int = 96, aux_layers=(0, 1, 1), seed: int = 0,
                      vocab_size: int | None = None) -> str:
    """A random EAGLE-3 head for `target` in the published format; its draft vocabulary the target's
    first `draft_vocab` ids spread out (d2t maps draft id i to target id 2 i)."""
    from safetensors.torch import save_file

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    hidden, heads, intermediate = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    kv_heads, head_dim = cfg.get("num_key_value_heads", heads), cfg["hidden_size"] // heads
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
              "num_hidden_layers": 1, "vocab_size": vocab_size or cfg["vocab_size"], "draft_vocab_size": draft_vocab,
              "rms_norm_eps": 1e-6, "rope_theta": cfg.get("rope_theta", 10000.0),
              "max_position_embeddings": cfg["max_position_embeddings"], "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    layer = "midlayer."
    tensors = {"fc.weight": rand(hidden, 3 * hidden), f"{layer}self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
               f"{layer}self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
               f"{layer}self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
               f"{layer}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
               f"{layer}mlp.gate_proj.weight": rand(intermediate, hidden), f"{layer}mlp.up_proj.weight": rand(intermediate, hidden),
               f"{layer}mlp.down_proj.weight": rand(hidden, intermediate),
               f"{layer}input_layernorm.weight": 1 + rand(hidden), f"{layer}hidden_norm.weight": 1 + rand(hidden),
               f"{layer}post_attention_layernorm.weight": 1 + rand(hidden), "norm.weight": 1 + rand(hidden),
               "lm_head.weight": rand(draft_vocab, hidden), "d2t": torch.arange(draft_vocab, dtype=torch.int64)}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory
