"""Process tuning for CPU inference.

glibc returns large freed blocks to the OS (mmap threshold, heap trimming), so
every step's multi-megabyte activations come back as fresh pages and are
faulted in again: on a 2-core machine that cost several times the attention
math itself. Raising both thresholds keeps freed memory in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_done = False


def keep_freed_memory_in_heap() -> bool:
    """Call once per process; True when glibc accepted the settings."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _done = ok
    return ok
