"""How much vision encoding one step may take (vLLM's encoder budget): a prefill chunk that would
need more images encoded than the step has left is cut before the first one that does not fit, so a
request with many images spreads their encoding over several steps instead of stalling every decode
of the batch for all of them at once. Images in the encoder cache cost nothing; an image larger than
the whole budget still runs, alone, in a step of its own."""

from __future__ import annotations

from ..sequence import Sequence
from .encoder_cache import EncoderCache


class EncoderBudget:
    def __init__(self, cache: EncoderCache, tokens_per_step: int, whole_images: bool = False):
        """whole_images: a chunk never ends inside an image (an image's tokens attend to one another,
        Gemma 3): it stops before the image, or takes the rest of it past the token budget."""
        self.cache, self.tokens_per_step, self.whole_images = cache, tokens_per_step, whole_images
        self._left = tokens_per_step
        self._charged: set[bytes] = set()

    def begin_step(self) -> None:
        self._left, self._charged = self.tokens_per_step, set()

    def cut(self, seq: Sequence, start: int, num_new: int) -> int:
        """The tokens of seq's chunk [start, start + num_new) this step may take, its images' encoding
        charged to the step."""
        if seq.mm is None:
            return num_new
        for image in seq.mm.overlapping(start, start + num_new):
            if image.content_hash in self._charged or image.content_hash in self.cache:
                continue
            if image.length > self._left and self._charged:
                return max(0, image.offset - start)  # the chunk stops before it; a later step encodes it
            self._left -= image.length
            self._charged.add(image.content_hash)
        end = start + num_new
        if self.whole_images:
            for image in seq.mm.overlapping(start, end):
                if end < image.end:  # the chunk would end inside it
                    return image.offset - start if image.offset > start else image.end - start
        return num_new
