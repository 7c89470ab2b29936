"""Kernels: each has a torch reference (test oracle) of the same signature; attention also
has a CPU implementation (paged_attention_cpu, the CPU path)."""

from .cache_write import write_kv_cache_ref
from .paged_attention import paged_attention_ref
from .paged_attention_cpu import paged_attention_cpu

__all__ = ["paged_attention_cpu", "paged_attention_ref", "write_kv_cache_ref"]
