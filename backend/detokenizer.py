"""IncrementalDetokenizer: a sequence's output text, one step at a time.

Tokens whose text would end in a split multi-byte character stay pending until
later tokens complete it, so no delta ever carries U+FFFD from a split, and
the deltas concatenate exactly to the decode of all output tokens.

With a fast (Rust) tokenizer each new token is one call of the `tokenizers`
package's DecodeStream, seeded with the last prompt tokens so a first output
token keeps its leading space; otherwise each step decodes the pending tokens
with a little context (`decode_delta`), two full decodes a token. Rendering runs
for every running request at every step, so on a GPU serving hundreds of streams
this is most of the host's work per step (benchmarks/host_overhead.py).
"""

from __future__ import annotations

from typing import Any

from .tokenizer import CONTEXT_TOKENS, decode_delta

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.token_ids = token_ids  # shared with the Sequence; grows as it generates
        self.num_prompt_tokens = num_prompt_tokens
        self.skip_special_tokens = skip_special_tokens
        self.rendered = num_prompt_tokens  # tokens before this index are in the text
        self.stepped = num_prompt_tokens  # tokens before this index went through the stream
        backend = getattr(tokenizer, "_tokenizer", None)
        self.backend = backend if DecodeStream is not None and backend is not None else None
        self.stream = None
        if self.backend is not None:
            self.stream = DecodeStream(ids=self.context(num_prompt_tokens), skip_special_tokens=skip_special_tokens)

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
        text = ""
        if self.stream is not None:
            text = self._step_stream()
            if self.stream is not None and not final:
                return text
        if self.rendered == len(self.token_ids):
            return text
        return text + self._decode_pending(final)  # a split character left at the end, or no stream

    def _step_stream(self) -> str:
        pieces = []
        while self.stepped < len(self.token_ids):
            try:
                chunk = self.stream.step(self.backend, self.token_ids[self.stepped])
            except Exception:  # noqa: BLE001 - tokenizers' stream refuses some byte sequences
                self.stream = None  # ("Invalid prefix encountered"): two-decode deltas from here on
                break
            self.stepped += 1
            if chunk is not None:
                pieces.append(chunk)
                self.rendered = self.stepped
        return "".join(pieces)

    def _decode_pending(self, final: bool) -> str:
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
