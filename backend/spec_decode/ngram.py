"""N-gram (prompt lookup) proposer: vLLM v1's `_find_longest_matched_ngram_and_propose_tokens`.

The longest suffix of the tokens so far, of n tokens with prompt_lookup_min <= n <=
prompt_lookup_max, that also occurs earlier; among occurrences of that length the earliest.
The proposal is the (up to k) tokens that follow that occurrence (it may run into the suffix
itself), fewer at the end of the tokens or where max_model_len leaves less room.
"""

from __future__ import annotations

from typing import Sequence


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int, max_len: int | None = None) -> list[int]:
    """Draft tokens for `tokens` (prompt + output), [] when no n-gram of at least min_n matches.
    One pass over the earlier occurrences of the last token: O(len(tokens) * max_n) at worst."""
    total = len(tokens)
    if max_len is not None:
        k = min(k, max_len - total)
    if k <= 0 or total < max(min_n, 1) + 1:
        return []
    last = tokens[-1]
    best_n, best_end = 0, -1
    end = 0  # exclusive end of an earlier occurrence: tokens[end - 1] == last, end <= total - 1
    index = tokens.index if isinstance(tokens, list) else list(tokens).index
    while True:
        try:
            end = index(last, end, total - 1) + 1
        except ValueError:
            break
        n = 1
        limit = min(max_n, end)
        while n < limit and tokens[end - 1 - n] == tokens[total - 1 - n]:
            n += 1
        if n > best_n:  # strictly longer only: the earliest occurrence of a length wins
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return list(tokens[best_end : best_end + k])
