"""What the C matmul tests share: whether a result depends on how many threads split the work.
A plain module (not collected)."""

from __future__ import annotations

from typing import Callable

import torch


def same_on_one_thread(compute: Callable[[], torch.Tensor]) -> bool:
    """Whether `compute()` gives bit for bit the same result on one thread as on torch's
    threads: each output's sum must not depend on which thread computed it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = compute()
    finally:
        torch.set_num_threads(threads)
    return torch.equal(compute(), alone)
