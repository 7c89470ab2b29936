"""Checkpoint formats. Each reads a model into one ModelConfig and a stream of
tensors under Hugging Face names, so the model loader knows no format:
hf.py (config.json + safetensors), gguf.py (llama.cpp GGUF, dequantized), and
prequantized.py (4-bit and FP8 projections as AWQ, GPTQ, compressed-tensors and ModelOpt store
them, collected from the stream and fused after it),
and dummy.py (random weights of a config's shape, for speed measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..model_config import ModelConfig


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Iterator[tuple[str, torch.Tensor]]
    """(Hugging Face name, tensor) pairs, read lazily."""
    num_tensors: int
    """How many `tensors` yields, for the progress bar."""
    random_weights: bool = False
    """No stored weights: the loader draws random ones of the config's shape (checkpoints/dummy.py)."""
