"""load_model: a checkpoint of any format in checkpoints/ into a LlamaForCausalLM.

Every format yields (name, tensor) pairs in Hugging Face naming; `load_weights`
copies them into the model with a progress bar, stacking the projections of each
packed module (q/k/v, gate/up) as the model's `packed_modules` table says, handing
each expert's tensors to its layer's SparseMoeBlock and quantized projections (AWQ, GPTQ,
compressed-tensors, ModelOpt) to PrequantizedLoader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from .checkpoints import Checkpoint
from .checkpoints.dummy import dummy_checkpoint, randomize
from .checkpoints.gguf import read_gguf_checkpoint
from .checkpoints.hf import hf_dir_config, read_hf_checkpoint
from .checkpoints.prequantized import PrequantizedLoader
from .errors import ConfigError
from .model_config import ModelConfig
from .model_files import is_gguf, resolve_model_path
from .models.linear import Linear
from .models.llama import LlamaForCausalLM, RotaryEmbedding
from .models.moe import SparseMoeBlock
from .models.parallel import SINGLE_RANK, TensorParallel, take_shard
from .tokenizer import load_tokenizer

CheckpointWeightHook = Callable[[Linear, torch.Tensor], None]
"""Called with a linear and its checkpoint weight as read, before the copy rounds it to the
model's dtype (the CPU backend keeps a half-precision layer's exact GGUF blocks this way)."""


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerBase


def read_checkpoint(path: str, load_format: str = "auto") -> Checkpoint:
    """The config and tensor stream of a GGUF file or a Hugging Face directory; with
    load_format "dummy" the config alone (random weights, checkpoints/dummy.py)."""
    if load_format == "dummy":
        return dummy_checkpoint(read_gguf_checkpoint(path).config if is_gguf(path) else hf_dir_config(path))
    return read_gguf_checkpoint(path) if is_gguf(path) else read_hf_checkpoint(path)


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, parallel: TensorParallel = SINGLE_RANK,
    load_format: str = "auto", on_linear_weight: CheckpointWeightHook | None = None,
) -> LoadedModel:
    """The model (this rank's share of it with tensor parallelism) and its tokenizer;
    `on_linear_weight` sees each linear's checkpoint weight before it is rounded."""
    path = resolve_model_path(path)
    checkpoint = read_checkpoint(path, load_format)
    model = load_checkpoint(checkpoint, dtype, device, parallel, on_linear_weight)
    return LoadedModel(model=model, config=checkpoint.config, tokenizer=load_tokenizer(path))


def load_checkpoint(
    checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, parallel: TensorParallel = SINGLE_RANK,
    on_linear_weight: CheckpointWeightHook | None = None,
) -> LlamaForCausalLM:
    """The checkpoint's weights in a model (this rank's slices of them), in eval mode."""
    config = checkpoint.config
    model = build_empty_model(config, dtype, device, config.max_position_embeddings, parallel)
    if checkpoint.random_weights:
        randomize(model)
        return model.eval()
    packed = None
    if config.packed_weights:
        packed = PrequantizedLoader(model.packed_modules, config)
    load_weights(model, checkpoint.tensors, checkpoint.num_tensors, packed, on_linear_weight)
    if packed is not None:
        packed.install(model, device, dtype)
    return model.eval()


def build_empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    parallel: TensorParallel = SINGLE_RANK,
) -> LlamaForCausalLM:
    """Allocate the model without initializing weights (they are loaded next)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, parallel)
        if config.packed_weights:  # filled from the quantized checkpoint tensors after loading
            for layer in model.decoder_layers:
                for name in model.linears_of(layer):
                    layer.set_submodule(name, torch.nn.Identity())
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config, max_positions).to(device)
    model.requires_grad_(False)
    return model


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)\.(\w+)")
_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    total: int,
    packed: PrequantizedLoader | None = None,
    on_linear_weight: CheckpointWeightHook | None = None,
) -> None:
    """Copy Hugging Face-named tensors into the model. The projections of a packed
    module are stacked into its rows once all of them have arrived (they may come in
    any order, across shards); packed 4-bit projections go to `packed`. With tensor
    parallelism each tensor is cut to this rank's slice first (the layer's `shards`)."""
    # checkpoint projection -> (our packed module, its place in it, how many parts it has)
    stacked_in = {
        part: (fused, index, len(parts)) for fused, parts in model.packed_modules.items() for index, part in enumerate(parts)
    }
    params = dict(model.named_parameters(remove_duplicate=False))
    experts = {f"layers.{i}.mlp": layer.mlp for i, layer in enumerate(model.decoder_layers)
               if isinstance(layer.mlp, SparseMoeBlock)}
    expected = {name for name in params if not (model.config.tie_word_embeddings and name == "lm_head.weight")
                and name.rpartition(".")[0] not in experts}  # the stacked experts count their own tensors
    pending: dict[str, list[tuple[str, torch.Tensor] | None]] = {}
    loaded: set[str] = set()
    for name, tensor in tqdm(tensors, total=total, desc="Loading weights", unit="tensor", leave=False):
        match = _LAYER.fullmatch(name)
        if match is None:
            target, index, count = _TOP_LEVEL.get(name), 0, 1
        else:
            layer, (module, _, kind) = match.group(1), match.group(2).rpartition(".")
            expert = _EXPERT.fullmatch(match.group(2))
            if expert is not None and f"layers.{layer}.mlp" in experts:
                number, projection, part = int(expert.group(1)), expert.group(2), expert.group(3)
                if packed is not None and packed.accepts_expert(part):
                    packed.add_expert(int(layer), number, projection, part, tensor)
                elif experts[f"layers.{layer}.mlp"].takes(part) or part in ("weight", "bias"):  # those: fit, or named
                    experts[f"layers.{layer}.mlp"].load_expert(number, projection, tensor, part)
                continue
            if packed is not None and packed.accepts(module, kind):
                packed.add(int(layer), module, kind, tensor)
                continue
            ours, index, count = stacked_in.get(module, (module, 0, 1))
            target = f"layers.{layer}.{ours}.{kind}"
        if target is None or target not in params:
            continue
        parts = pending.setdefault(target, [None] * count)
        owner, _, kind = target.rpartition(".")
        parts[index] = (name, take_shard(model.get_submodule(owner), index, tensor, kind))
        if all(part is not None for part in parts):
            rows = [part for part in pending.pop(target) if part is not None]  # all of them, as checked
            _copy_rows(params[target], rows)
            loaded.add(target)
            if on_linear_weight is not None:
                _show_checkpoint_weight(model, target, rows, on_linear_weight)
    missing = sorted(expected - loaded) + [f"{name}.{tensor}" for name, block in experts.items() for tensor in block.missing()]
    if missing:
        raise ConfigError("model", f"checkpoint lacks tensors for {missing[:6]}{' ...' if len(missing) > 6 else ''}")


def _show_checkpoint_weight(model: LlamaForCausalLM, target: str, parts: list[tuple[str, torch.Tensor]],
                            hook: CheckpointWeightHook) -> None:
    """The checkpoint's own values of a linear weight (the embedding, for a tied LM head),
    before the copy rounded them, to `hook`."""
    owner, _, kind = target.rpartition(".")
    tied = owner == "embed_tokens" and model.config.tie_word_embeddings
    linear = model.lm_head if tied else model.get_submodule(owner)
    if kind == "weight" and isinstance(linear, Linear):
        hook(linear, torch.cat([tensor for _, tensor in parts]))


@torch.no_grad()
def _copy_rows(param: torch.Tensor, parts: list[tuple[str, torch.Tensor]]) -> None:
    """Copy one tensor into the parameter, or stack several along its rows."""
    start = 0
    for name, tensor in parts:
        dest = param if len(parts) == 1 else param[start : start + tensor.shape[0]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ConfigError("model", f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        start += tensor.shape[0]
    if start != param.shape[0]:
        raise ConfigError("model", f"tensors {[name for name, _ in parts]} stack to {start} rows, expected {param.shape[0]}")
