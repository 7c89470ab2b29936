"""IncrementalDetokenizer: a sequence's output text, one step at a time.

Tokens whose text would end in a split multi-byte character stay pending until
later tokens complete it, so no delta ever carries U+FFFD from a split, and
the deltas concatenate exactly to the decode of all output tokens.
"""

from __future__ import annotations

from typing import Any

from .tokenizer import CONTEXT_TOKENS, decode_delta


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.token_ids = token_ids  # shared with the Sequence; grows as it generates
        self.num_prompt_tokens = num_prompt_tokens
        self.skip_special_tokens = skip_special_tokens
        self.rendered = num_prompt_tokens  # tokens before this index are in the text

    @property
    def num_rendered_output_tokens(self) -> int:
        return self.rendered - self.num_prompt_tokens

    def context(self, end: int) -> list[int]:
        return self.token_ids[max(0, end - CONTEXT_TOKENS) : end]

    def update(self, final: bool = False) -> str:
        """Text of the newly renderable tokens ("" while they are pending).

        final=True renders pending tokens too (the sequence has ended), split
        characters and all.
        """
        if self.rendered == len(self.token_ids):
            return ""
        delta = decode_delta(
            self.tokenizer,
            self.context(self.rendered),
            self.token_ids[self.rendered :],
            self.skip_special_tokens,
            allow_partial=final,
        )
        if delta is None:
            return ""
        self.rendered = len(self.token_ids)
        return delta
