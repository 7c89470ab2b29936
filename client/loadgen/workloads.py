"""What to send, seeded, so that every system compared gets the same requests.

Prompts are synthetic, or one per line of a JSONL file (`{"prompt": ..., "max_tokens": ...}`).
Synthetic prompts are random words from a fixed list. With a tokenizer (default: the
bundled model's) the list is cut to words that are exactly one token both at the start
and after a space, so a prompt of n words is n tokens; each prompt is checked with the
tokenizer and its real count recorded. Without one (`tokenizer=None`), n words is only
approximately n tokens. Output lengths are forced with `ignore_eos`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from .config import BenchConfig

# Common English words; with a tokenizer, those that are not one token are dropped.
VOCABULARY = (
    "the of and to in is was for on are with as be at by this had not but from or have an they which one "
    "you were all her she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three place small found part house home "
    "water light river city country field music story paper money table window garden school market road "
    "train green blue red white black open close early late quick slow warm cold happy quiet simple strong "
    "bright clear dark deep soft hard short tall wide young ready free full sure true whole real best better "
    "number point group problem fact hand eye head face name word family friend night morning evening week "
    "month game line side end form order power course level rest kind sort change interest reason study plan"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: prompt text, forced output length, and the prompt's token
    count when the client knows it (synthetic prompts with a tokenizer)."""

    index: int
    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None


class Workload(Protocol):
    def request(self, index: int) -> RequestSpec: ...


def _uniform(rng: random.Random, mean: int, spread: int) -> int:
    return max(1, rng.randint(mean - spread, mean + spread))


def single_token_words(tokenizer: Any, words: Sequence[str] = VOCABULARY) -> list[str]:
    """Words the tokenizer encodes as one token both alone and after a space."""
    keep = []
    for word in words:
        alone = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(alone) == 1 and len(spaced) == 1:
            keep.append(word)
    if len(keep) < 20:
        raise ValueError("the tokenizer keeps fewer than 20 single-token words; pass tokenizer=None")
    return keep


def count_tokens(tokenizer: Any, text: str) -> int:
    """Prompt tokens as the server counts them (pagedserve encodes with the defaults)."""
    return len(tokenizer.encode(text))


@dataclass
class SyntheticWorkload:
    """Random-word prompts of uniform length in mean ± range, outputs in len ± range.

    Request i depends only on (seed, i), so every system and every concurrency level
    sees the same prompts in the same order.
    """

    prompt_len_mean: int = 128
    prompt_len_range: int = 64
    output_len: int = 64
    output_len_range: int = 0
    seed: int = 0
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self._words = single_token_words(self.tokenizer) if self.tokenizer is not None else list(VOCABULARY)

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(f"prompt:{self.seed}:{index}")
        target = _uniform(rng, self.prompt_len_mean, self.prompt_len_range)
        prompt = " ".join(rng.choice(self._words) for _ in range(target))
        tokens = count_tokens(self.tokenizer, prompt) if self.tokenizer is not None else None
        return RequestSpec(index, prompt, _uniform(rng, self.output_len, self.output_len_range), tokens)


@dataclass
class JsonlWorkload:
    """Prompts from a JSONL file, `{"prompt": "...", "max_tokens": N}` per line (max_tokens
    optional; otherwise output_len ± output_len_range). Requests cycle through the file."""

    path: str | Path
    output_len: int = 64
    output_len_range: int = 0
    seed: int = 0
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self._lines: list[tuple[str, int | None]] = []
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    prompt = item["prompt"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.path}:{number}: expected {{\"prompt\": ...}}: {exc}") from None
                if not isinstance(prompt, str):
                    raise ValueError(f"{self.path}:{number}: 'prompt' must be a string")
                max_tokens = item.get("max_tokens")
                self._lines.append((prompt, int(max_tokens) if max_tokens is not None else None))
        if not self._lines:
            raise ValueError(f"{self.path}: no prompts")

    def request(self, index: int) -> RequestSpec:
        prompt, max_tokens = self._lines[index % len(self._lines)]
        if max_tokens is None:
            max_tokens = _uniform(random.Random(f"output:{self.seed}:{index}"), self.output_len, self.output_len_range)
        tokens = count_tokens(self.tokenizer, prompt) if self.tokenizer is not None else None
        return RequestSpec(index, prompt, max_tokens, tokens)


def load_workload(config: BenchConfig) -> Workload:
    """The workload `config` describes (a JSONL file if given, else synthetic), with its tokenizer loaded."""
    tokenizer = None
    if config.tokenizer is not None:
        from pagedserve.backend.model_files import default_model_path
        from pagedserve.backend.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer or default_model_path())
    if config.prompts_jsonl:
        return JsonlWorkload(config.prompts_jsonl, config.output_len, config.output_len_range, config.seed, tokenizer)
    return SyntheticWorkload(
        config.prompt_len_mean, config.prompt_len_range, config.output_len, config.output_len_range, config.seed, tokenizer
    )
