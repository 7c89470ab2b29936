"""OutputRenderer: turns a sequence's sampled tokens into the deltas a client sees.

It renders text incrementally, finds stop strings (also when they span token
boundaries), holds back the few characters that might start a stop string, and
releases tokens only at clean text boundaries. Stop strings live here rather
than in the scheduler because only rendered text can show them. With a stream
interval N > 1 a delta waits until N new tokens are ready (vLLM's
`stream_interval`): fewer, larger deltas, the first and the last never delayed.
"""

from __future__ import annotations

from typing import Any

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput
from .sequence import Sequence
from .tokenizer import CONTEXT_TOKENS


class OutputRenderer:
    def __init__(self, seq: Sequence, tokenizer: Any, stream_interval: int = 1, final_only: bool = False):
        """final_only: the caller reads the finished output alone (offline `generate`); then,
        unless a stop string needs the text as it grows, nothing is rendered before the end
        and the whole text is decoded once (vLLM's FINAL_ONLY output kind)."""
        self.seq = seq
        self.stream_interval = stream_interval
        params = seq.params
        self.deferred = final_only and not params.stop
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.token_ids, seq.num_prompt_tokens, params.skip_special_tokens
        )
        self.stops = params.stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.token_ends: list[int] = []  # len(text) after each output token
        self.boundaries: list[int] = []  # output-token counts at which text was clean
        self.stop_at: int | None = None  # where the output text ends (a stop string hit)
        self.sent_tokens = 0
        self.sent_chars = 0
        self.cumulative_logprob = 0.0
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.wants_logprobs = params.logprobs is not None

    def on_token(self) -> bool:
        """Account for the token just appended to the sequence; True if a stop string hit."""
        if self.deferred:
            return False
        detokenizer, token_ends = self.detokenizer, self.token_ends
        delta = detokenizer.update()
        if delta:
            self.text += delta
        token_ends.append(len(self.text))
        if detokenizer.rendered - self.num_prompt_tokens == len(token_ends):  # a clean text boundary
            self.boundaries.append(len(token_ends))
        if delta and self.stops:
            return self._find_stop(len(self.text) - len(delta))
        return False

    def _find_stop(self, new_from: int) -> bool:
        start = max(0, new_from - self.holdback)
        hits = [(self.text.find(s, start), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.stop_at = index + (len(stop) if self.seq.params.include_stop_str_in_output else 0)
        return True

    def _releasable(self) -> int | None:
        """The most output tokens that may be released now: up to the last clean boundary
        whose text holds nothing that could start a stop string; None if none is new."""
        boundaries = self.boundaries
        if not boundaries or boundaries[-1] <= self.sent_tokens:
            return None
        if not self.stops:  # no holdback: the last boundary (the common case, at every step)
            return boundaries[-1]
        limit = len(self.text) - self.holdback
        return next((b for b in reversed(boundaries) if b > self.sent_tokens and self.token_ends[b - 1] <= limit), None)

    def collect(self, finished: bool) -> RequestOutput | None:
        """The delta since the last call; None if nothing new can be released yet."""
        end_token: int | None
        if finished:
            self.text += self.detokenizer.update(final=True)
            end_token = self.seq.num_output_tokens
            end_char = len(self.text) if self.stop_at is None else self.stop_at
            trim = len(self.text) - end_char
        elif self.deferred:
            return None
        else:
            end_token = self._releasable()
            if end_token is None:
                return None
            if self.sent_tokens and end_token - self.sent_tokens < self.stream_interval:
                return None  # not the first delta, and fewer than stream_interval tokens ready
            end_char, trim = self.token_ends[end_token - 1], 0
        seq, prompt, sent_tokens, sent_chars = self.seq, self.num_prompt_tokens, self.sent_tokens, self.sent_chars
        first = prompt + sent_tokens
        logprobs, cumulative = [], None
        if self.wants_logprobs:
            logprobs = seq.logprobs[sent_tokens:end_token]
            self.cumulative_logprob += sum(lp.logprob for lp in logprobs)
            cumulative = self.cumulative_logprob
        token_ids = seq.token_ids
        output = RequestOutput(
            seq.request_id,
            token_ids[first : prompt + end_token],
            token_ids[max(0, first - CONTEXT_TOKENS) : first],
            self.text[sent_chars:end_char] if end_char > sent_chars else "",
            finished,
            seq.finish_reason.value if finished and seq.finish_reason else None,
            trim,
            logprobs,
            prompt,
            end_token,
            seq.num_cached_tokens,
            cumulative,
            None,
            seq.sample_index,
        )  # positional, in RequestOutput's field order: this runs for every request at every step
        self.sent_tokens, self.sent_chars = end_token, max(end_char, sent_chars)
        return output
