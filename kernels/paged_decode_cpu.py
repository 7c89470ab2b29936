"""The CPU decode attention that reads the paged cache in place (kernels/paged_decode_cpu.c).

Why C: torch has no CPU op that reads through a block table, so the torch-op path copies
every decode's keys and values out of the cache (index_select) before a flash kernel reads
them again; that copy and the flash kernel's tiling for one query row were ~20 ms of a
~60 ms decode step (32 sequences, SmolLM2, bf16). The C loop reads each key and value row
once, where it lies.

Built at first use with the machine's C compiler (the one inductor uses for the compiled
step: $CC, else cc), `-O3 -march=native -fopenmp`, into ~/.cache/pagedserve/kernels
(keyed by source, flags and CPU), and loaded with ctypes: the library links libgomp, which
resolves to the OpenMP runtime torch has already loaded, so its threads are torch's. No
compiler, or a failed build: `native_decode()` returns None once, with a warning naming
the cause, and the torch-op decode runs instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("pagedserve")

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Cache (and query) dtypes the C loop reads; others (fp16, fp8 caches) take the torch-op path."""
DISABLE_ENV = "PAGEDSERVE_NATIVE_DECODE"
"""Set to 0 to keep the torch-op decode (benchmarks compare the two)."""

NativeDecode = Callable[..., None]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve" / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """-march=native code runs only where it was built: the CPU model and flags key the build."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def build(cc: str) -> Path:
    """The shared library for this source, flags and CPU, compiled unless already cached.
    Written under a temporary name and renamed, so concurrent loads never see half a file."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_decode_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
        os.replace(partial, target)
    return target


_lock = threading.Lock()
_loaded: list[NativeDecode | None] = []


def native_decode() -> NativeDecode | None:
    """The C decode as a callable (see `paged_decode`), or None where it cannot be built."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> NativeDecode | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        logger.warning("CPU decode attention: no C compiler (set CC or install gcc); using the slower torch-op decode")
        return None
    try:
        library = ctypes.CDLL(str(build(cc)))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU decode attention: build failed, using the slower torch-op decode: %s", exc)
        return None
    function = library.paged_decode
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function.argtypes = [p, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
    function.restype = i32
    return function


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the C loop takes these tensors: the same float dtype for query and cache, a
    contiguous cache, query heads contiguous within a token (its rows may be a view's)."""
    head_dim = query.shape[-1]
    return (query.dtype in DTYPES and key_cache.dtype == query.dtype and key_cache.is_contiguous()
            and query.stride(-1) == 1 and query.stride(-2) == head_dim)


def paged_decode(
    function: NativeDecode, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
    tables: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor, scale: float,
) -> bool:
    """Write the decodes' attention into out[rows] (out contiguous). tables: int32 [num_decodes, width] (this
    step's decodes only), lens: int32 [num_decodes], rows: int64 query rows. False when the
    shapes are beyond the C loop's fixed buffers (the caller falls back)."""
    _, block_size, kv_heads, head_dim = key_cache.shape
    status = function(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), rows.data_ptr(),
        rows.numel(), query.shape[1], kv_heads, head_dim, block_size, scale, DTYPES[query.dtype],
        torch.get_num_threads(),
    )
    return status == 0


__all__ = ["DISABLE_ENV", "build", "native_decode", "paged_decode", "supports"]
