"""GGUF files (llama.cpp): a lean reader, metadata into a ModelConfig, and the
tensors dequantized to float32 under Hugging Face names.

The `gguf` package's own reader builds numpy views for every token string of the
vocabulary and takes seconds; this one walks the file with struct over one mmap
and leaves tensor decoding to `gguf.quants.dequantize`. GGUF converters permute
the q/k rows for llama.cpp's rope layout; the tensors are un-permuted back to the
Hugging Face layout the model uses.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from pagedserve.kernels.numerics import cdiv

from ..errors import ConfigError
from ..model_config import ModelConfig
from ..model_files import DEFAULT_SAMPLING, is_default_model
from . import Checkpoint


def read_gguf_checkpoint(path: str) -> Checkpoint:
    reader = GGUFFile(path)
    config = gguf_model_config(reader)
    if is_default_model(path):
        config.generation_defaults = dict(DEFAULT_SAMPLING)
    return Checkpoint(config, _gguf_tensors(reader, config), len(reader.tensors))


def gguf_model_config(reader: GGUFFile) -> ModelConfig:
    """The ModelConfig of a llama-architecture GGUF, from its metadata and tensor list."""
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
        source_block_format=_block_format(layer_types),
    )


def _block_format(qtypes: set[int]) -> str | None:
    """"q4_1" / "q8_0" when every layer's weights are in that one format (the formats whose
    blocks kernels/cpu/block_matmul.py multiplies), else None."""
    from gguf import GGMLQuantizationType

    formats = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    return formats.get(GGMLQuantizationType(next(iter(qtypes)))) if len(qtypes) == 1 else None


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
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
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


# -- the reader ----------------------------------------------------------------
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {0: np.float32, 1: np.float16}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first)
    qtype: int
    data: np.ndarray  # raw bytes or floats as stored

    def to_numpy(self) -> np.ndarray:
        """Float32 array of the tensor (dequantized)."""
        if self.qtype in _FLOAT_TYPES:
            return self.data.astype(np.float32).reshape(self.shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(self.data, GGMLQuantizationType(self.qtype)).reshape(self.shape)


class GGUFFile:
    """Metadata fields and tensor views of one GGUF file (version 2 or 3)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._map[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self._offset = 4
        version = self._read("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or 3 expected)")
        num_tensors, num_fields = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._read_string()
            self.fields[key] = self._read_value(self._read("<I"), keep_arrays=not key.startswith("tokenizer.ggml."))
        infos = []
        for _ in range(num_tensors):
            name = self._read_string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = cdiv(self._offset, alignment) * alignment
        self.tensors = [self._tensor(name, shape, qtype, data_start + offset) for name, shape, qtype, offset in infos]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _tensor(self, name: str, shape: tuple[int, ...], qtype: int, offset: int) -> GGUFTensor:
        count = int(np.prod(shape))
        if qtype in _FLOAT_TYPES:
            data = np.frombuffer(self._map, dtype=_FLOAT_TYPES[qtype], count=count, offset=offset)
        else:
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            row_bytes = shape[-1] // block * type_size
            data = np.frombuffer(self._map, dtype=np.uint8, count=count // shape[-1] * row_bytes, offset=offset)
            data = data.reshape(-1, row_bytes)
        return GGUFTensor(name, shape, qtype, data)

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._read("<Q")
        raw = self._map[self._offset : self._offset + length]
        self._offset += length
        return raw.decode("utf-8", errors="replace")

    def _read_value(self, kind: int, keep_arrays: bool = True) -> Any:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._read_string()
        if kind == _ARRAY:
            item_kind, count = self._read("<I"), self._read("<Q")
            if item_kind in _SCALARS and not keep_arrays:  # skip large numeric arrays quickly
                self._offset += count * struct.calcsize(_SCALARS[item_kind])
                return count
            items = [self._read_value(item_kind, keep_arrays) for _ in range(count)]
            return items if keep_arrays else count
        raise ValueError(f"unknown GGUF value type {kind}")
