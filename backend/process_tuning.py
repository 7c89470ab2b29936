"""Process tuning: the glibc heap and huge pages for CPU tensors, and the names of our threads.

glibc returns large freed blocks to the OS (mmap threshold, heap trimming), so
every step's multi-megabyte activations come back as fresh pages and are
faulted in again: on a 2-core machine that cost several times the attention
math itself. Raising both thresholds keeps freed memory in the heap for reuse.

Also the names our threads carry in the OS (`top -H`, `perf`, /proc), which Python
does not set: every thread of a Triton stub is otherwise `triton_python_b`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_done = False


def keep_freed_memory_in_heap() -> bool:
    """Call once per process; True when glibc accepted the settings."""
    global _done
    if _done:
        return _done
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    except AttributeError:  # not glibc (musl has no mallopt)
        return False
    _done = ok
    return ok


_MADV_HUGEPAGE = 14


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large, not yet touched CPU tensor with 2 MiB pages (call before
    filling it). The paged KV cache is read a block at a time from anywhere in it: with
    4 KiB pages nearly every block costs a TLB miss. Applies to the tensor's 2 MiB-aligned
    interior; False where the kernel or libc says no (THP off: nothing changes)."""
    libc = _libc() if tensor.device.type == "cpu" else None
    if libc is None:
        return False
    huge = 2 * 1024 * 1024
    start = -(-tensor.data_ptr() // huge) * huge
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // huge * huge
    if end <= start:
        return False
    try:
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except AttributeError:
        return False


_PR_SET_NAME = 15
_NAME_BYTES = 15  # the kernel keeps 15 bytes and a terminating zero


def name_native_thread(name: str) -> bool:
    """Give the calling thread `name` (its first 15 bytes) in the OS, so per-thread CPU
    readings tell the engine, its OpenMP workers (they inherit the name of the thread that
    starts them) and the response thread apart. False where the OS has no such call."""
    libc = _libc()
    if libc is None:
        return False
    try:
        return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_NAME_BYTES]), 0, 0, 0) == 0
    except AttributeError:
        return False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (these are Linux calls), else None; looked up once
    (find_library runs ldconfig, and the KV cache asks for every layer's tensors)."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
