"""Images in, text out: what a vision-language model adds to the text engine, in one room.

- `vlm_config`: which checkpoints are vision-language models, the language model's config and
  tensor names inside them (the text engine loads that part as any text model);
- `images`: bytes or PIL images in, decoded under a pixel cap, with a content hash;
- `processor`: the checkpoint's own processor (transformers' AutoProcessor) turns a prompt and its
  images into token ids with the placeholders expanded and the pixels each image's encoder reads;
- `inputs`: a prompt's images (hash, placeholder range, pixels), which the block manager folds into
  its block hashes so the prefix cache never mixes two images;
- `encoder`: the checkpoint's vision tower and projector (transformers' own modules, run as they run
  them), once per image;
- `encoder_cache`: encoder outputs by image hash, so a conversation resending an image does not
  encode it again;
- `step_embeddings`: a step's placeholder rows and the image embeddings that replace their token
  embeddings (chunked prefill may cut an image anywhere).
"""

from .inputs import ImageItem, MultiModalPrompt
from .vlm_config import VLM_ARCHITECTURES, is_vision_language

__all__ = ["ImageItem", "MultiModalPrompt", "VLM_ARCHITECTURES", "is_vision_language"]
