"""What the quantized-GEMM tests (`test_int4`, `test_fp8`) share: the device and Triton
availability, the error metric and its per-dtype bounds, and the real-shape GPU cases.
A plain module (not collected); import it before the kernels, as it sets
TRITON_INTERPRET=1 without CUDA."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)

# Bounds on relative Frobenius error against the float64 product, per output dtype.
REF_TOL = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}
TRITON_TOL = {torch.bfloat16: 8e-3, torch.float16: 5e-4}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------- GPU, real shapes

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def llama_shapes(test):
    """Marks `test(shape, m)` as a CUDA-only `gpu` test over Llama-3-8B's linear layers
    and M in 1, 16, 300."""
    test = pytest.mark.parametrize("m", [1, 16, 300])(test)
    test = pytest.mark.parametrize("shape", list(LLAMA3_8B))(test)
    test = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test)
    return pytest.mark.gpu(test)


def llama_case(shape: str, m: int):
    """(w [N, K] fp32 ~ N(0, 0.02^2), x [m, K] bf16, bias [N] bf16) on CUDA, seeded."""
    n, k = LLAMA3_8B[shape]
    gen = torch.Generator(device="cuda").manual_seed(40)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    return w, x, b
