"""A request's prompt as token ids, without running it: for routers that place requests by
prefix. vLLM's router asks every worker to render each request before it chooses one
(`/v1/chat/completions/render`, `/v1/completions/render`, else `/tokenize`), and indexes the
KV-cache events workers publish by those same ids.

The ids come from the engine's own code (`parse_prompt`: the chat template, tools and template
variables, or the raw prompt) fed the very inputs the gateway sends the `llm` model, with the
tokenizer the engine loads for the model Triton serves (its `model` parameter, read from the
model's configuration, or `--tokenizer`): they are the ids whose KV blocks the engine caches.
Each tokenizer loads off the event loop, from the gateway's start on (`preload`, retried while
Triton is not up yet), so a router's first render does not wait for it (vLLM's router gives a
render a few seconds, then places the request without one).

A chat with images to a vision-language model renders as the engine makes it: the checkpoint's own
processor expands each image's placeholder to its tokens (their count depends on the picture for
Qwen2.5-VL), and vLLM's `features` say which tokens are which image (`mm_placeholders`) and what
each image is (`mm_hashes`: the content hashes the engine folds into those blocks' hashes and
publishes as their KV events' `extra_keys`), so a router hashes the same blocks the engine does.
The images are decoded here under the engine's own caps and processor settings (`limit_mm_per_prompt`,
`max_image_pixels`, `mm_processor_kwargs` from the model's configuration).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import numpy as np

from .errors import OpenAIError
from .translate import LLMRequest

PROMPT_INPUTS = ("text_input", "messages", "tools", "chat_template_kwargs", "image")
"""The `llm` inputs that make the prompt's ids."""
IMAGE_LIMITS = ("limit_mm_per_prompt", "max_image_pixels", "mm_processor_kwargs")
"""The engine settings an image prompt is processed under (from the model's configuration)."""
PRELOAD_RETRY_S = 2.0

log = logging.getLogger("pagedserve.openai")


class PromptTokenizers:
    """One PromptTokenizer per Triton model, made on first use; `preload` loads them at start."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._by_model: dict[str, PromptTokenizer] = {}

    def get(self, triton: Any, model: str) -> PromptTokenizer:
        if model not in self._by_model:
            self._by_model[model] = PromptTokenizer(triton, model, self.path)
        return self._by_model[model]

    async def preload(self, triton: Any, models: Iterable[str]) -> None:
        """Load each model's tokenizer, retrying while Triton cannot say which model it serves."""
        for model in models:
            while True:
                try:
                    await self.get(triton, model).tokenizer()
                    break
                except OpenAIError:
                    await asyncio.sleep(PRELOAD_RETRY_S)
                except Exception:  # a tokenizer that cannot load: the routes say why when asked
                    log.exception("cannot load the tokenizer of model %s", model)
                    break


class PromptTokenizer:
    """The served model's tokenizer, and a request's prompt ids as the engine will make them."""

    def __init__(self, triton: Any, model: str, path: str | None = None):
        """`triton`: the gateway's TritonLLM (for the model's `model` parameter when `path` is None)."""
        self.triton, self.model, self.path = triton, model, path
        self._tokenizer: Any = None
        self._processor: Any = None
        self._takes_images: bool | None = None
        self._lock = asyncio.Lock()

    async def tokenizer(self) -> Any:
        async with self._lock:
            if self._tokenizer is None:
                path = self.path if self.path is not None else await self._served_model_path()
                self._tokenizer = await asyncio.to_thread(_load, path)
            return self._tokenizer

    async def takes_images(self) -> bool | None:
        """Whether the served model is a vision-language model (its config.json, where the gateway can
        read it); None where it cannot tell."""
        if self._takes_images is None:
            try:
                path = self.path if self.path is not None else await self._served_model_path()
                self._takes_images = await asyncio.to_thread(_takes_images, path)
            except Exception:  # noqa: BLE001 - Triton not ready, or the path not readable here: unknown
                return None
        return self._takes_images

    async def image_processor(self) -> Any:
        """The served vision-language model's ImagePromptProcessor, under the engine's image caps; a 400
        naming `image` for a text model."""
        async with self._lock:
            if self._processor is None:
                parameters = await self._parameters() if self.path is None else {}
                path = self.path if self.path is not None else parameters.get("model", "")
                self._processor = await asyncio.to_thread(_load_processor, path, parameters)
        if self._processor is False:
            raise OpenAIError(400, "`image`: this model takes no images; serve a vision-language model", param="image")
        return self._processor

    async def _parameters(self) -> dict[str, str]:
        try:
            return await self.triton.model_parameters(self.model)
        except Exception as error:  # noqa: BLE001 - unreachable, not loaded: the route cannot answer yet
            raise OpenAIError(503, f"cannot read model `{self.model}`'s configuration from Triton to load its tokenizer "
                                   f"({error}); retry once the server is ready, or start the gateway with --tokenizer",
                              code="service_unavailable") from None

    async def _served_model_path(self) -> str:
        return (await self._parameters()).get("model", "")

    async def render(self, request: LLMRequest) -> tuple[list[int], dict[str, Any] | None]:
        """The prompt's token ids as the engine makes them and, with images, vLLM's render `features`
        (None without); `request`'s images fetched already (LLMRequest.fetch_images)."""
        from pagedserve.backend.errors import InvalidRequestError
        from pagedserve.backend.triton_adapter.requests import image_input, image_prompt, parse_prompt

        inputs = request.inputs()
        arrays = {name: np.array(inputs[name] if name == "image" else [inputs[name]], dtype=np.object_)
                  for name in PROMPT_INPUTS if name in inputs}
        try:
            if "image" not in arrays:
                return await asyncio.to_thread(parse_prompt, arrays, await self.tokenizer()), None
            processor = await self.image_processor()
            ids, mm, _ = await asyncio.to_thread(processor.expand, image_prompt(arrays, image_input(arrays) or []))
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=error.field) from None
        return ids, {"mm_hashes": {"image": [image.content_hash.hex() for image in mm.images]},
                     "mm_placeholders": {"image": [{"offset": image.offset, "length": image.length}
                                                   for image in mm.images]}}


def _takes_images(path: str) -> bool:
    from pagedserve.backend.model_files import resolve_model_path
    from pagedserve.backend.multimodal.vlm_config import takes_images

    return takes_images(resolve_model_path(path))


def _load_processor(path: str, parameters: dict[str, str]) -> Any:
    """The model's ImagePromptProcessor under the image caps its configuration sets (the engine's
    defaults elsewhere); False for a text model."""
    from pagedserve.backend.config import EngineConfig
    from pagedserve.backend.model_files import resolve_model_path
    from pagedserve.backend.multimodal.processor import ImagePromptProcessor
    from pagedserve.backend.multimodal.vlm_config import takes_images

    model_dir = resolve_model_path(path)
    if not takes_images(model_dir):
        return False
    caps = EngineConfig.from_strings({key: parameters[key] for key in IMAGE_LIMITS if parameters.get(key)})
    return ImagePromptProcessor.for_model(model_dir, caps.max_images_per_prompt, caps.max_image_pixels,
                                          caps.processor_kwargs)


def _load(path: str) -> Any:
    from pagedserve.backend.model_files import resolve_model_path
    from pagedserve.backend.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(path))
