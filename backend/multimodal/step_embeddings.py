"""A step's image rows: which rows of the flat batch hold image placeholder tokens, and the image
embeddings that replace their token embeddings. A prefill chunk may start or end inside an image
(chunked prefill, a prefix-cache hit that ends mid-image): its rows take the matching slice of the
image's embeddings, which are encoded once (EncoderCache) whichever chunk needs them first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from ..sequence import Sequence
from .encoder import VisionEncoder
from .encoder_cache import EncoderCache
from .inputs import ImageItem


@dataclass
class EmbeddingPatch:
    """Rows of a step's input embeddings to overwrite, and what with."""

    rows: torch.Tensor  # [k] int64
    values: torch.Tensor  # [k, hidden]
    rope_positions: torch.Tensor | None = None
    """[3, k] int64: the rows' multimodal rotary positions (time, height, width), None without them."""
    visible_until: np.ndarray | None = None
    """[k] int32: the last position each row sees (its image's last), where an image's tokens see one
    another (Gemma 3); None: causal."""


class ImageEmbedder:
    def __init__(self, encoder: VisionEncoder, cache: EncoderCache, bidirectional: bool = False):
        """bidirectional: an image's tokens attend to one another (Gemma 3), so a prefill chunk that
        holds an image's tokens holds all of them (EncoderBudget) and they see the whole image."""
        self.encoder, self.cache, self.bidirectional = encoder, cache, bidirectional
        self.num_encoded = 0

    def embeddings(self, image: ImageItem) -> torch.Tensor:
        """The image's embeddings, [length, hidden], from the cache or encoded now."""
        found = self.cache.get(image.content_hash)
        if found is None:
            found = self.encoder.encode(image.pixels)
            if found.shape[0] != image.length:
                raise ValueError(f"the encoder gave {found.shape[0]} embeddings for an image of {image.length} tokens")
            self.num_encoded += 1
            self.cache.put(image.content_hash, found)
        return found

    def patch(self, seqs: Seq[Sequence], starts: np.ndarray, query_start: np.ndarray) -> EmbeddingPatch | None:
        """The step's image rows (sequence i's tokens [starts[i], starts[i] + its query length) sit at
        rows query_start[i]...), or None where no scheduled token is an image's."""
        rows: list[np.ndarray] = []
        values: list[torch.Tensor] = []
        positions: list[np.ndarray] = []
        until: list[np.ndarray] = []
        for i, seq in enumerate(seqs):
            if seq.mm is None:
                continue
            start, end = int(starts[i]), int(starts[i]) + int(query_start[i + 1] - query_start[i])
            for image in seq.mm.overlapping(start, end):
                first, last = max(start, image.offset), min(end, image.end)
                rows.append(np.arange(first, last, dtype=np.int64) - start + int(query_start[i]))
                values.append(self.embeddings(image)[first - image.offset:last - image.offset])
                if seq.mm.rope_positions is not None:
                    positions.append(seq.mm.rope_positions[:, first:last])
                if self.bidirectional:
                    until.append(np.full(last - first, image.end - 1, dtype=np.int32))
        if not rows:
            return None
        rope = torch.from_numpy(np.concatenate(positions, axis=1)) if positions else None
        return EmbeddingPatch(torch.from_numpy(np.concatenate(rows)), torch.cat(values), rope,
                              np.concatenate(until) if until else None)
