"""Single-stream latency, timed the same way for every system (no imports: the vLLM
peer's worker runs it in its own venv): time to first token is a 1-token generate of the
prompt; the decode rate is the extra tokens of a full generate over its extra time.
Best of a few repeats, so a stray background process does not decide the number."""

from __future__ import annotations

import time
from typing import Callable


def time_single_stream(generate: Callable[[list[int], int], None], prompt: list[int], output_len: int,
                       repeats: int = 3) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s) of generate(prompt, max_tokens) run alone."""
    def best(max_tokens: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            generate(prompt, max_tokens)
            times.append(time.perf_counter() - start)
        return min(times)

    generate(prompt, 2)  # warm-up
    first, full = best(1), best(output_len)
    return first, (output_len - 1) / (full - first)
