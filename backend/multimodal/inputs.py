"""A prompt's images as the engine carries them: where each image's placeholder tokens lie in
the prompt, what identifies its content, and the pixels its encoder reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass(eq=False)
class ImageItem:
    """One image of a prompt: its tokens are prompt positions [offset, offset + length)."""

    content_hash: bytes
    """Of the decoded pixels (images.image_hash): equal pictures share encoder outputs and KV blocks."""
    offset: int
    length: int
    pixels: dict[str, Any] = field(repr=False, default_factory=dict)
    """The processor's tensors for this image alone (pixel_values, ...), as the encoder takes them."""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class MultiModalPrompt:
    """The images of one prompt, in prompt order."""

    images: list[ImageItem]
    rope_positions: Any = None
    """Multimodal rotary positions (Qwen2.5-VL): [3, prompt tokens] int64 numpy (time, height, width),
    equal in all three for text tokens; None: a token's position is its index."""
    rope_delta: int = 0
    """What a token past the prompt adds to its index for its position (the image tokens' positions
    advance by their grid, not one each)."""

    def rope_position(self, indices: Any) -> Any:
        """The (text) positions of token indices, numpy: a prompt token's from the table (its time
        row), a later one's its index plus rope_delta."""
        table = self.rope_positions[0]
        inside = indices < table.shape[0]
        return np.where(inside, table[np.minimum(indices, table.shape[0] - 1)], indices + self.rope_delta)

    def hash_key(self, start: int, end: int) -> bytes:
        """What a block of prompt positions [start, end) adds to its hash: the content hash of each
        image with a token inside it (the same tokens with another image are another block)."""
        return b"".join(image.content_hash for image in self.images if image.offset < end and start < image.end)

    def overlapping(self, start: int, end: int) -> list[ImageItem]:
        """The images with a token among positions [start, end)."""
        return [image for image in self.images if image.offset < end and start < image.end]


def rotary_positions(seqs: Sequence[Any], indices: np.ndarray, query_start: np.ndarray) -> np.ndarray:
    """The positions a step's tokens turn by: their indices, but a prompt with multimodal rotary
    positions (Qwen2.5-VL) gives its tokens their own, and the tokens after it their index plus its
    shift (an image token's height and width rows go with its embedding patch,
    step_embeddings.py). `seqs`: the step's sequences, their tokens indices[query_start[i]:
    query_start[i + 1]]."""
    shifted = None
    for i, seq in enumerate(seqs):
        if seq.mm is None or seq.mm.rope_positions is None:
            continue
        shifted = indices.copy() if shifted is None else shifted
        begin, end = query_start[i], query_start[i + 1]
        shifted[begin:end] = seq.mm.rope_position(indices[begin:end])
    return indices if shifted is None else shifted
