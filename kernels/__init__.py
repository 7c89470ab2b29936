"""Kernels, one folder per family: each operation's interface and torch reference (the tests'
oracle) here (paged_attention, cache_write, fp8, int4), the GPU kernels in the Triton language
in triton/, the CPU ones in C with their bindings in cpu/. dispatch.py is the one place that
picks among them; a family is imported only where it runs."""
