"""What the engine holds for a vision-language model: the processor that turns a prompt and its
images into tokens and pixels, and the embedder a step asks for image rows (encoder + cache)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .encoder import VisionEncoder
from .encoder_budget import EncoderBudget
from .encoder_cache import EncoderCache
from .inputs import MultiModalPrompt
from .processor import ImagePromptProcessor
from .step_embeddings import ImageEmbedder
from .vlm_config import BIDIRECTIONAL_IMAGES


class ImageInputs:
    def __init__(self, processor: ImagePromptProcessor, embedder: ImageEmbedder):
        self.processor, self.embedder = processor, embedder

    @classmethod
    def load(cls, model_dir: str, family: str, tensors: Any, device: torch.device, dtype: torch.dtype,
             max_images: int, max_pixels: int, cache_bytes: int,
             processor_kwargs: dict[str, Any] | None = None) -> ImageInputs:
        """The image side of the vision-language checkpoint at `model_dir` (`family`: its
        ModelConfig.vision_language), its weights from `tensors`; `max_images` a prompt's images,
        `max_pixels` an image's, `cache_bytes` the encoder cache's, `processor_kwargs` the image
        processor's settings (EngineConfig's limit_mm_per_prompt, max_image_pixels,
        encoder_cache_bytes, mm_processor_kwargs)."""
        processor = ImagePromptProcessor.for_model(model_dir, max_images, max_pixels, processor_kwargs)
        encoder = VisionEncoder.load(model_dir, tensors, device, dtype)
        return cls(processor, ImageEmbedder(encoder, EncoderCache(cache_bytes), bidirectional=family in BIDIRECTIONAL_IMAGES))

    def budget(self, tokens_per_step: int) -> EncoderBudget:
        """The scheduler's encoder budget over this model's encoder cache."""
        return EncoderBudget(self.embedder.cache, tokens_per_step, whole_images=self.embedder.bidirectional)

    def process(self, prompt: Mapping[str, Any]) -> tuple[list[int], MultiModalPrompt]:
        """Token ids and images of vLLM's prompt dict with images (ImagePromptProcessor.expand), with
        multimodal rotary positions where the model has them."""
        ids, mm, whole = self.processor.expand(prompt)
        found = self.embedder.encoder.rope_index(whole)
        if found is not None:
            mm.rope_positions, mm.rope_delta = found
        return ids, mm

