"""Kernels: each has a torch reference (CPU path, test oracle) of the same signature."""

from .cache_write import write_kv_cache_ref
from .paged_attention import paged_attention_ref

__all__ = ["paged_attention_ref", "write_kv_cache_ref"]
