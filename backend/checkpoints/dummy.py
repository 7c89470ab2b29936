"""Random weights of a checkpoint's shape (`load_format: dummy`).

Speed does not depend on the weights' values once outputs are forced (`ignore_eos`), so
a model too large to ship or download is measured with its real shape and random values,
as vLLM's `--load-format dummy` does. Only the checkpoint's config (and, for the engine,
its tokenizer) is read; the values are drawn on the model's own device, so an 8B model
fills in well under a second on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model_config import ModelConfig
from . import Checkpoint

INIT_STD = 0.02
"""Hugging Face's `initializer_range` for Llama: keeps activations finite through every layer."""


def dummy_checkpoint(config: ModelConfig) -> Checkpoint:
    """A checkpoint of `config`'s shape with no stored tensors: the loader fills the model
    with `randomize` instead of copying weights."""
    if config.packed_weights or config.mxfp4_experts:  # random dense weights; quantize on load for the quantized kernels
        config.packed_weights, config.mxfp4_experts = None, False
        config.source_group_size = None
        config.fp8_block = None
    return Checkpoint(config, iter(()), 0, random_weights=True)


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, biases 0, every other parameter N(0, INIT_STD^2), drawn in place
    from a generator seeded on the parameters' device (the same values on every run)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            generator = generators.get(param.device)
            if generator is None:
                generator = generators[param.device] = torch.Generator(device=param.device)
                generator.manual_seed(seed)
            param.normal_(0.0, INIT_STD, generator=generator)
