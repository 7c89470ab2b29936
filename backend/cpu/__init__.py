"""The CPU backend: what an engine on CPU does beyond the code every device shares.

Its parts: the weight forms a dense linear takes and the matmul each reads
(linear_methods.py), the timing probe that picks the dtype and the float32 layouts
(matmul_probe.py), the decoder layers as one C call (decoder_stack.py), and `CpuBackend`
(backend.py), the one object through which an engine on CPU reaches them, made once at load.
Under them lie the C kernels and their bindings (kernels/cpu/).

The boundary: the modules the GPU path runs (the engine, the model, the runner, the
sampler) import nothing from here or from kernels/cpu/ at module level; the engine makes a
`CpuBackend` on CPU only, and the model's per-op C kernels come through kernels/dispatch.py,
which imports them on CPU tensors only. tests/test_import_boundaries.py walks the imports.
"""
