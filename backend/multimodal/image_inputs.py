"""What the engine holds for a vision-language model: the processor that turns a prompt and its
images into tokens and pixels, and the embedder a step asks for image rows (encoder + cache)."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from .encoder import VisionEncoder
from .encoder_budget import EncoderBudget
from .encoder_cache import EncoderCache
from .images import DEFAULT_MAX_IMAGE_PIXELS
from .inputs import MultiModalPrompt
from .processor import DEFAULT_MAX_IMAGES, ImagePromptProcessor
from .step_embeddings import ImageEmbedder
from .vlm_config import BIDIRECTIONAL_IMAGES, VLM_ARCHITECTURES, is_vision_language

DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


class ImageInputs:
    def __init__(self, processor: ImagePromptProcessor, embedder: ImageEmbedder):
        self.processor, self.embedder = processor, embedder

    @classmethod
    def load(cls, model_dir: str, tensors: Any, device: torch.device, dtype: torch.dtype,
             max_images: int = DEFAULT_MAX_IMAGES, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
             cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> ImageInputs | None:
        """The image side of the checkpoint at `model_dir` (its weights from `tensors`), None for a
        text model; `max_images` a prompt's images, `max_pixels` an image's, `cache_bytes` the encoder
        cache's (EngineConfig's limit_mm_per_prompt, max_image_pixels, encoder_cache_bytes)."""
        config = read_config(model_dir)
        if config is None or not is_vision_language(config):
            return None
        token_id = config.get("image_token_index", config.get("image_token_id"))
        if token_id is None:
            raise ConfigError("model", f"{model_dir}: config.json names no image token (image_token_index)")
        processor = ImagePromptProcessor(model_dir, int(token_id), max_images, max_pixels)
        encoder = VisionEncoder.load(model_dir, tensors, device, dtype)
        family = VLM_ARCHITECTURES[config["architectures"][0]]
        return cls(processor, ImageEmbedder(encoder, EncoderCache(cache_bytes), bidirectional=family in BIDIRECTIONAL_IMAGES))

    def budget(self, tokens_per_step: int) -> EncoderBudget:
        """The scheduler's encoder budget over this model's encoder cache."""
        return EncoderBudget(self.embedder.cache, tokens_per_step, whole_images=self.embedder.bidirectional)

    def process(self, prompt: str, images: Sequence[Any]) -> tuple[list[int], MultiModalPrompt]:
        """Token ids and images of a prompt, with multimodal rotary positions where the model has them."""
        ids, mm = self.processor.process(prompt, images)
        found = self.embedder.encoder.rope_index(mm.processed)
        if found is not None:
            mm.rope_positions, mm.rope_delta = found
        mm.processed = {}
        return ids, mm


def read_config(model_dir: str) -> dict[str, Any] | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)

