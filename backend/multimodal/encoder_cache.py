"""Encoder outputs by image content hash, least recently used dropped first past a byte budget:
a conversation that resends an image (every turn does, in the OpenAI API) is not encoded again."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return found

    def put(self, key: bytes, value: torch.Tensor) -> None:
        """Keep `value` (an image's embeddings); one larger than the whole budget is not kept."""
        size = value.numel() * value.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = value
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
