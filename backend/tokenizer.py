"""Prompt encoding and stateless delta decoding shared by the engine and the Triton models."""

from __future__ import annotations

from typing import Any, Sequence

from .errors import InvalidRequestError

CONTEXT_TOKENS = 4
"""Tokens of left context a delta decode needs (SentencePiece leading spaces)."""


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def apply_chat_template(tokenizer: Any, messages: Any, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat (list of {"role", "content"} messages) in the model's template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise InvalidRequestError(f"messages[{index}]", "must be an object with string 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model has no chat template; send plain text instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_delta(
    tokenizer: Any,
    context_ids: Sequence[int],
    new_ids: Sequence[int],
    skip_special_tokens: bool = True,
    allow_partial: bool = False,
) -> str | None:
    """Text that new_ids add after context_ids; None while it ends in a split
    multi-byte character (more tokens will complete it).

    Decoding with a little left context keeps leading spaces exact, so deltas
    concatenate to the full decode. Stateless: the postprocessing model uses it
    with the context ids the engine sends along. allow_partial renders a split
    character as U+FFFD instead (the last delta of a finished sequence).
    """
    options = dict(skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    prefix = tokenizer.decode(list(context_ids), **options) if context_ids else ""
    full = tokenizer.decode(list(context_ids) + list(new_ids), **options)
    if full.endswith("\ufffd") and not allow_partial:
        return None
    return full[len(prefix) :]
