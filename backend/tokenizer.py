"""The model's tokenizer: loading it (with an on-disk cache for the slow GGUF
conversion), prompt encoding and stateless delta decoding, shared by the engine,
the Triton models and the client tools."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

from pagedserve.kernels.cache_dir import cache_root

from .errors import ConfigError, InvalidRequestError
from .model_files import is_gguf, resolve_model_path

CONTEXT_TOKENS = 4
"""Tokens of left context a delta decode needs (SentencePiece leading spaces)."""


def load_tokenizer(path: str) -> Any:
    """The model's tokenizer. A GGUF's is converted once by transformers (slow) and
    kept in the cache directory ($PAGEDSERVE_CACHE_DIR, default ~/.cache/pagedserve)."""
    from transformers import AutoTokenizer

    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    cache = _tokenizer_cache_dir(path)
    if os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        partial = f"{cache}.tmp{os.getpid()}"
        tokenizer.save_pretrained(partial)
        os.replace(partial, cache)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def tokenizer_dir(path: str) -> str:
    """A Hugging Face tokenizer directory for the model, for tools that take one
    (genai-perf's --tokenizer, Triton's OpenAI frontend): the model directory itself,
    or for a GGUF file its converted tokenizer in the cache."""
    path = resolve_model_path(path)
    if not is_gguf(path):
        return path
    load_tokenizer(path)
    cache = _tokenizer_cache_dir(path)
    if not os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        raise ConfigError(
            "model", f"could not write the converted tokenizer to {cache}; set PAGEDSERVE_CACHE_DIR to a writable directory"
        )
    return cache


def _tokenizer_cache_dir(path: str) -> str:
    """Keyed by the file's path, size and mtime and the transformers version."""
    import transformers

    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return str(cache_root() / "tokenizers" / hashlib.sha1(key.encode()).hexdigest()[:16])


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def encode_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each non-empty word's token ids, alone and without special tokens (TensorRT-LLM's
    stop/bad word lists, and the bad words of its text inputs)."""
    return [list(tokenizer.encode(word, add_special_tokens=False)) for word in words if word]


TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "return_dict",
                                "continue_final_message", "chat_template", "tokenizer_kwargs", "return_tensors",
                                "padding", "truncation", "max_length", "return_assistant_tokens_mask"})
"""apply_chat_template's own arguments, which the server sets (or leaves) itself and which
`chat_template_kwargs` may not: a request must not swap the served template (`chat_template`: any
Jinja of the client's choosing) nor the tokenizing around it."""


def apply_chat_template(tokenizer: Any, messages: Any, add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, template_kwargs: Any = None) -> list[int]:
    """Token ids of a chat in the model's template: a list of {"role", "content"} messages,
    where an assistant turn may carry `tool_calls` and a `tool` turn answers one; `tools`
    (function definitions, OpenAI's shape) are handed to the template, which decides how
    the model sees them; `template_kwargs` (vLLM's chat_template_kwargs: Qwen3's
    enable_thinking, gpt-oss's reasoning_effort, ...) are the template's own variables."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise InvalidRequestError(f"messages[{index}]", "must be an object with string 'role' and 'content'")
        if not isinstance(message.get("tool_calls", []), list):
            raise InvalidRequestError(f"messages[{index}].tool_calls", "must be a list of tool calls")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise InvalidRequestError("tools", "must be a JSON list of tool definitions (objects)")
    template_kwargs = {} if template_kwargs is None else template_kwargs
    if not isinstance(template_kwargs, dict) or not all(isinstance(key, str) for key in template_kwargs):
        raise InvalidRequestError("chat_template_kwargs", "must be a JSON object of the chat template's variables")
    reserved = sorted(TEMPLATE_ARGUMENTS & set(template_kwargs))
    if reserved:
        raise InvalidRequestError("chat_template_kwargs", f"may not set {reserved}: the server sets them (send "
                                                          "`messages` and `tools` as their own inputs)")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model has no chat template; send plain text instead")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as error:  # noqa: BLE001 - the template's own refusal (jinja's raise_exception, a missing key)
        raise InvalidRequestError("messages", f"the model's chat template refused them: {error}") from None
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
