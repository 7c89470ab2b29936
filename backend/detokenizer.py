"""IncrementalDetokenizer: a sequence's output text, one step at a time.

Tokens whose text would end in a split multi-byte character stay pending until
later tokens complete it, so no delta ever carries U+FFFD from a split, and
the deltas concatenate exactly to the decode of all output tokens.

Three ways, the first that applies:
- byte-level BPE tokenizers (GPT-2's decoder alone: Llama 3, Qwen, SmolLM, Mistral Nemo...):
  the text is the UTF-8 decoding of the tokens' bytes laid end to end, so each token's bytes
  come from a table made once per tokenizer (`ByteLevelTable`) and no decoder runs at all;
- other fast (Rust) tokenizers: each new token is one call of the `tokenizers` package's
  DecodeStream, seeded with the last prompt tokens so a first output token keeps its leading
  space;
- otherwise each step decodes the pending tokens with a little context (`decode_delta`).
Rendering runs for every running request at every step, so on a GPU serving hundreds of
streams it is most of the host's work per step (benchmarks/host_overhead.py).
"""

from __future__ import annotations

import json
from typing import Any

from .tokenizer import CONTEXT_TOKENS, decode_delta

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None  # type: ignore[assignment,misc]  # the name stands for "no streaming decoder" there


class ByteLevelTable:
    """Each token's bytes, for a tokenizer whose decoder is byte-level alone; special tokens apart."""

    def __init__(self, pieces: list[bytes], special: frozenset[int]):
        self.pieces, self.special = pieces, special

    @classmethod
    def of(cls, tokenizer: Any) -> ByteLevelTable | None:
        """The tokenizer's table (made once and kept on it), or None where its decoding is not
        the bytes laid end to end (another decoder, a normalizer-dependent vocabulary...)."""
        if hasattr(tokenizer, "_pagedserve_byte_table"):
            return tokenizer._pagedserve_byte_table
        table = None
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None:
            try:
                table = cls._build(backend)
            except Exception:  # noqa: BLE001 - any surprise in the spec: the general path is exact
                table = None
        try:
            tokenizer._pagedserve_byte_table = table
        except AttributeError:
            pass
        return table

    @classmethod
    def _build(cls, backend: Any) -> ByteLevelTable | None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        spec = json.loads(backend.to_str())
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        byte_of = {stand_in: byte for byte, stand_in in bytes_to_unicode().items()}  # GPT-2's printable stand-ins
        size = backend.get_vocab_size(with_added_tokens=True)
        pieces: list[bytes] = [b""] * size
        for token, index in backend.get_vocab(with_added_tokens=False).items():
            if any(c not in byte_of for c in token) or index >= size:
                return None
            pieces[index] = bytes(byte_of[c] for c in token)
        special = set()
        for added in spec.get("added_tokens") or []:
            index = added["id"]
            if index >= size:
                return None
            pieces[index] = added["content"].encode()
            if added.get("special"):
                special.add(index)
        return cls(pieces, frozenset(special))


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, token_ids: list[int], num_prompt_tokens: int, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.token_ids = token_ids  # shared with the Sequence; grows as it generates
        self.num_prompt_tokens = num_prompt_tokens
        self.skip_special_tokens = skip_special_tokens
        self.rendered = num_prompt_tokens  # tokens before this index are in the text
        self.stepped = num_prompt_tokens  # tokens before this index went through the stream
        self.table = ByteLevelTable.of(tokenizer)
        self.pending = b""  # bytes of stepped tokens not yet a whole character (byte-level path)
        backend = getattr(tokenizer, "_tokenizer", None)
        self.backend = backend if DecodeStream is not None and backend is not None and self.table is None else None
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
        ids = self.token_ids
        if self.rendered == len(ids):
            return ""
        table = self.table
        if table is not None:
            stepped = self.stepped
            if stepped + 1 == len(ids) and not self.pending:  # one new token, no character pending: most steps
                token = ids[stepped]
                if not (self.skip_special_tokens and token in table.special) and token < len(table.pieces):
                    try:
                        text = table.pieces[token].decode()
                    except UnicodeDecodeError:
                        return self._step_bytes(final)
                    self.stepped = self.rendered = stepped + 1
                    return text
            return self._step_bytes(final)
        text = ""
        if self.stream is not None:
            text = self._step_stream()
            if self.stream is not None and not final:
                return text
        if self.rendered == len(self.token_ids):
            return text
        return text + self._decode_pending(final)  # a split character left at the end, or no stream

    def _step_bytes(self, final: bool) -> str:
        """The new tokens' bytes after what is pending; released where they end a whole
        character (a token that ends inside one waits for the next), as a full decode would."""
        table, ids, pieces = self.table, self.token_ids, []
        assert table is not None  # update() takes this path only with a table
        skip = self.skip_special_tokens
        while self.stepped < len(ids):
            token = ids[self.stepped]
            self.stepped += 1
            if skip and token in table.special:
                piece = b""
            else:
                try:
                    piece = table.pieces[token]
                except IndexError:  # past the tokenizer's vocabulary (a padded embedding): no text
                    piece = b""
            pending = self.pending + piece
            try:
                pieces.append(pending.decode())
            except UnicodeDecodeError as error:
                if error.reason == "unexpected end of data" and (not final or self.stepped < len(ids)):
                    self.pending = pending  # a character split over tokens: wait for the rest
                    continue
                pieces.append(pending.decode(errors="replace"))  # bytes no character can be made of
            self.pending = b""
            self.rendered = self.stepped
        if final and self.pending:
            pieces.append(self.pending.decode(errors="replace"))
            self.pending, self.rendered = b"", self.stepped
        return "".join(pieces)

    def _step_stream(self) -> str:
        pieces = []
        stream, backend = self.stream, self.backend
        assert stream is not None and backend is not None  # update() takes this path only with a stream
        while self.stepped < len(self.token_ids):
            try:
                chunk = stream.step(backend, self.token_ids[self.stepped])
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
