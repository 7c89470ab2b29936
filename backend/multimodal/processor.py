"""The checkpoint's own processor (transformers' AutoProcessor): a prompt with image placeholders
and its images become token ids with each placeholder expanded to the image's tokens, and the
pixels the vision tower reads, exactly as the model was trained on them."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import ConfigError, InvalidRequestError
from ..model_files import read_model_json
from .images import image_hash, load_image, pixels_hash
from .inputs import ImageItem, MultiModalPrompt

_PER_IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw")
"""The processor's outputs with one row per image (pixel_values: one row per patch, with a grid)."""
_PROMPT_KEYS = ("input_ids", "mm_token_type_ids", "image_grid_thw")
"""What multimodal rotary positions are computed from (multimodal/rope.py)."""


def load_processor(model_dir: str) -> Any:
    """The checkpoint's processor (AutoProcessor). One whose video part cannot load (a video processor
    needs torchvision, which serving images does not: Qwen2.5-VL's, LLaVA-OneVision's): the same class
    with its image processor and tokenizer only, set up from its processor_config.json."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except (OSError, ImportError, ValueError, AttributeError) as error:
        config = dict(read_model_json(model_dir, "processor_config.json")
                      or read_model_json(model_dir, "preprocessor_config.json") or {})
        base = getattr(transformers, config.pop("processor_class", ""), None)
        if base is None or "video_processor" not in getattr(base, "get_attributes", lambda: [])():
            raise ConfigError("model", f"{model_dir}: its processor does not load ({error})") from None

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None  # no videos are served
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config.setdefault("chat_template", getattr(tokenizer, "chat_template", None))
    return ImageOnly(image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=tokenizer,
                     video_processor=None, **config)


def _per_image(out: Any, count: int) -> list[dict[str, Any]]:
    """Each image's share of the processor's outputs: its row of each, or with a patch grid
    (image_grid_thw: Qwen2.5-VL) its rows of pixel_values, one per patch."""
    if "image_grid_thw" not in out:
        return [{key: out[key][i:i + 1] for key in _PER_IMAGE_KEYS if key in out} for i in range(count)]
    grids = out["image_grid_thw"]
    ends = grids.prod(dim=-1).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return [{"pixel_values": out["pixel_values"][start:end], "image_grid_thw": grids[i:i + 1]}
            for i, (start, end) in enumerate(zip(starts, ends))]


class ImagePromptProcessor:
    """Prompts with images for one vision-language checkpoint."""

    def __init__(self, model_dir: str, image_token_id: int, max_images: int, max_pixels: int,
                 processor_kwargs: dict[str, Any] | None = None):
        """max_images: a prompt's images at most (EngineConfig's limit_mm_per_prompt); max_pixels: an
        image's (max_image_pixels); processor_kwargs: the image processor's settings for every prompt
        (mm_processor_kwargs), each one it has (ConfigError naming the key otherwise)."""
        self.processor = load_processor(model_dir)
        self.kwargs = dict(processor_kwargs or {})
        image_processor = self.processor.image_processor
        for key in self.kwargs:
            if not hasattr(image_processor, key):
                known = sorted(k for k, v in vars(image_processor).items() if not k.startswith("_") and
                               isinstance(v, (bool, int, float, str, type(None))))
                raise ConfigError("mm_processor_kwargs", f"{key!r} is not a setting of {type(image_processor).__name__} "
                                                         f"(it has {', '.join(known)})")
        self.image_token_id = image_token_id
        self.placeholder: str = (getattr(self.processor, "boi_token", None) or getattr(self.processor, "image_token", None)
                                 or self.processor.tokenizer.convert_ids_to_tokens(image_token_id))
        """The text a prompt writes where an image goes (LLaVA's `<image>`, Qwen2.5-VL's `<|image_pad|>`,
        Gemma 3's `<start_of_image>`)."""
        self.max_images, self.max_pixels = max_images, max_pixels

    @classmethod
    def for_model(cls, model_dir: str, max_images: int, max_pixels: int,
                  processor_kwargs: dict[str, Any] | None = None) -> ImagePromptProcessor:
        """The processor of the checkpoint at `model_dir`, its image token read from its config.json."""
        config = read_model_json(model_dir, "config.json") or {}
        token_id = config.get("image_token_index", config.get("image_token_id"))
        if token_id is None:
            raise ConfigError("model", f"{model_dir}: config.json names no image token (image_token_index)")
        return cls(model_dir, int(token_id), max_images, max_pixels, processor_kwargs)

    def expand(self, prompt: Mapping[str, Any]) -> tuple[list[int], MultiModalPrompt, dict[str, Any]]:
        """`process` for vLLM's prompt dict with images: `messages` (image parts become the chat
        template's placeholders; `chat_template_kwargs` beside them) or a `prompt` with a placeholder per
        image, and `multi_modal_data`'s `image` (one, or a list)."""
        images = (prompt.get("multi_modal_data") or {}).get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        messages = prompt.get("messages")
        text = self.render_chat(messages, prompt.get("chat_template_kwargs")) if messages is not None else prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("prompt", "must be a non-empty string with a placeholder for each image")
        return self.process(text, images)

    def process(self, prompt: str, images: Sequence[Any],
                field: str = "image") -> tuple[list[int], MultiModalPrompt, dict[str, Any]]:
        """Token ids of `prompt` (one placeholder per image, in order), its images, and the processor's
        whole-prompt outputs multimodal rotary positions are computed from; InvalidRequestError naming
        the field for too many images, an unreadable one, or placeholders that do not match."""
        if len(images) > self.max_images:
            raise InvalidRequestError(field, f"{len(images)} images; the limit is {self.max_images} (the engine's "
                                             "limit_mm_per_prompt)")
        decoded = [load_image(image, f"{field}[{i}]" if len(images) > 1 else field, self.max_pixels)
                   for i, image in enumerate(images)]
        count = prompt.count(self.placeholder)
        if count != len(decoded):
            raise InvalidRequestError("prompt", f"has {count} image placeholders ({self.placeholder}) for {len(decoded)} "
                                                f"images; put one {self.placeholder} where each image goes")
        try:
            out = self.processor(images=decoded or None, text=prompt, return_tensors="pt", **self.kwargs)
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(field, f"the model's processor refused it: {error}") from None
        ids = out["input_ids"][0].tolist()
        rows = len(out["pixel_values"]) if "pixel_values" in out and "image_grid_thw" not in out else len(decoded)
        pieces = _per_image(out, rows)  # more rows than images: crops beside their image (Gemma 3's pan-and-scan),
        hashes = ([pixels_hash(piece["pixel_values"]) for piece in pieces] if rows > len(decoded)  # each its own run
                  else [image_hash(image) for image in decoded])  # of tokens, named by its pixels
        items = [ImageItem(content_hash, offset, length, piece)
                 for content_hash, (offset, length), piece in zip(hashes, self._placeholder_ranges(ids, rows), pieces)]
        return ids, MultiModalPrompt(items), {key: out[key] for key in _PROMPT_KEYS if key in out}

    def render_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None) -> str:
        """Chat messages as prompt text through the checkpoint's chat template (the processor's), an
        image part ({"type": "image"}) written as the template writes an image's placeholder."""
        try:
            return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **(template_kwargs or {}))
        except (ValueError, TypeError, KeyError) as error:
            raise InvalidRequestError("messages", f"the model's chat template refused them: {error}") from None

    def _placeholder_ranges(self, ids: list[int], num_images: int) -> list[tuple[int, int]]:
        """(offset, length) of each image's expanded placeholder tokens: the runs of the image token,
        one per image, or split evenly where images touch (each image has the same count there)."""
        runs: list[list[int]] = []
        for position, token in enumerate(ids):
            if token == self.image_token_id:
                if runs and runs[-1][0] + runs[-1][1] == position:
                    runs[-1][1] += 1
                else:
                    runs.append([position, 1])
        if len(runs) == num_images:
            return [(start, length) for start, length in runs]
        total = sum(length for _, length in runs)
        if num_images == 0 or total % num_images:
            if num_images == 0 and not runs:
                return []
            raise InvalidRequestError("prompt", f"expands to {total} image tokens for {num_images} images")
        each = total // num_images
        ranges = []
        for start, length in runs:
            if length % each:
                raise InvalidRequestError("prompt", f"an image token run of {length} is not a whole number of images")
            ranges += [(start + k * each, each) for k in range(length // each)]
        return ranges
