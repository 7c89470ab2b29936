"""The GPU kernels in the Triton language, their launch scaffolding (gemm) and the ahead-of-time
compile gate (aot). Imported only where a kernel runs on CUDA (or under TRITON_INTERPRET=1)."""
