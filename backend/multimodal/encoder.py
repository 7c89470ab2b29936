"""The checkpoint's vision tower and projector, built by transformers from the checkpoint's config
and run through the model's own `get_image_features`: an image's embeddings are exactly the ones
transformers puts in place of its placeholder tokens. The language model is the text engine's
(paged, with its kernels); the one transformers would build here is dropped unbuilt."""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch

from ..errors import ConfigError
from .vlm_config import language_model_name


class VisionEncoder:
    """Image embeddings [tokens, hidden] for one image's processor outputs."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype):
        self.model, self.device, self.dtype = model, device, dtype

    @classmethod
    def load(cls, model_dir: str, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device,
             dtype: torch.dtype) -> VisionEncoder:
        """The encoder of the checkpoint at `model_dir`, its weights from `tensors` (the checkpoint's,
        every one: the language model's are skipped). ConfigError naming what is missing or left over."""
        from transformers import AutoConfig, AutoModelForImageTextToText
        from transformers.initialization import no_init_weights

        config = AutoConfig.from_pretrained(model_dir)
        shell = copy.deepcopy(config)
        text = shell.get_text_config()
        text.num_hidden_layers = 0  # the language model is built empty, then dropped
        if hasattr(text, "layer_types"):
            text.layer_types = []
        previous = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)
            with no_init_weights(), torch.device(device):
                full = AutoModelForImageTextToText.from_config(shell)
        finally:
            torch.set_default_dtype(previous)
        model = full.model
        model.language_model = None  # get_image_features never reads it
        params = dict(model.state_dict())
        loaded: set[str] = set()
        left_over: list[str] = []
        for name, tensor in tensors:
            if language_model_name(name) is not None:
                continue
            target = _module_name(name, params)
            if target is None:
                left_over.append(name)
                continue
            with torch.no_grad():
                params[target].copy_(tensor.to(params[target].dtype))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing or left_over:
            raise ConfigError("model", f"the vision encoder's weights do not match its config: missing {missing[:5]}, "
                                       f"not used {left_over[:5]}")
        return cls(model.eval(), device, dtype)

    @torch.inference_mode()
    def encode(self, pixels: dict[str, Any]) -> torch.Tensor:
        """One image's embeddings, [tokens, hidden], from its processor outputs."""
        inputs = {key: value.to(self.device, self.dtype if value.is_floating_point() else value.dtype)
                  for key, value in pixels.items()}
        features = self.model.get_image_features(**inputs, return_dict=True).pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features), dim=0)
        return features.reshape(-1, features.shape[-1])

    def rope_index(self, processed: dict[str, Any]) -> tuple[Any, int] | None:
        """A prompt's multimodal rotary positions, [3, tokens] numpy, and the shift of the tokens after
        it, by the model's own get_rope_index; None for a model without them."""
        rope_index = getattr(self.model, "get_rope_index", None)
        if rope_index is None or "mm_token_type_ids" not in processed:
            return None
        positions, delta = rope_index(processed["input_ids"], processed["mm_token_type_ids"],
                                      image_grid_thw=processed.get("image_grid_thw"))
        return positions[:, 0].numpy().astype("int64"), int(delta.reshape(-1)[0])


def _module_name(name: str, params: dict[str, torch.Tensor]) -> str | None:
    """The encoder's parameter a checkpoint tensor fills: its name without the `model.` prefix of
    transformers 5's layout, or without the `vision_model.` level older vision towers had."""
    for candidate in (name, name.removeprefix("model.")):
        if candidate in params:
            return candidate
        flat = candidate.replace(".vision_model.", ".", 1)
        if flat in params:
            return flat
    return None
