"""The Triton attention backend, and when to use it.

Importing a name that needs triton from here raises ImportError when triton is
missing (backend/attention.py turns that into a ConfigError); `use_triton` works
either way.
"""

from __future__ import annotations

import os

import torch

try:
    from .cache_write_triton import write_kv_cache_triton
    from .paged_attention_triton import paged_attention_triton
except ImportError as error:  # no triton (or a triton without what the kernels need)
    _TRITON_ERROR: ImportError | None = error
else:
    _TRITON_ERROR = None

FORCE_ENV = "PAGEDSERVE_FORCE_TRITON"


def triton_available() -> bool:
    return _TRITON_ERROR is None


def use_triton(tensor: torch.Tensor) -> bool:
    """True for a CUDA tensor when triton is importable; PAGEDSERVE_FORCE_TRITON=1 forces
    the Triton path on any device (on CPU that needs TRITON_INTERPRET=1 set before
    the kernels are first imported)."""
    if not triton_available():
        return False
    if os.environ.get(FORCE_ENV, "0") == "1":
        return True
    return tensor.is_cuda


if _TRITON_ERROR is None:

    def triton_attention_backend():
        """AttentionBackend(write_cache=write_kv_cache_triton, attend=paged_attention_triton)."""
        from pagedserve.backend.attention import AttentionBackend  # lazy: backend imports kernels

        return AttentionBackend(write_cache=write_kv_cache_triton, attend=paged_attention_triton)


_NEEDS_TRITON = ("triton_attention_backend", "paged_attention_triton", "write_kv_cache_triton")


def __getattr__(name: str):
    # Only reached for names not defined above, i.e. when the triton import failed.
    if name in _NEEDS_TRITON:
        raise ImportError(f"pagedserve.kernels.dispatch.{name} needs triton: {_TRITON_ERROR}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["triton_attention_backend", "use_triton", "triton_available"]
