"""The batch-invariant Triton launches (kernels/triton/batch_invariant.py, and the attention's and MoE
kernels' `batch_invariant` launches): each against its torch reference within rounding, and a row's
result to the bit the same alone, beside other rows, and (attention) however its prompt was chunked.

On CPU the kernels run in the interpreter, with a dot that sums every row of a tile alike as a GPU's
MMA does (tests/interpreter.py: numpy's own matmul, the interpreter's, does not on every CPU): there
the bit-for-bit checks test the launchers' logic (fixed tiles, tiles aligned to key positions under a
sliding window, the experts summed in order), not a GPU's instructions; on a GPU the same tests run
compiled.
Bounds, max |out - ref| / max |ref|: float32 1e-5, bfloat16 1e-2 (both sides round the output).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.moe import route

from ..interpreter import use_row_uniform_dot
from .paged_batch import DEVICE, Batch
from .test_moe import TOL as MOE_TOL, experts

triton = pytest.importorskip("triton")
from pagedserve.kernels.moe import fused_moe_ref  # noqa: E402
from pagedserve.kernels.triton import batch_invariant as bi  # noqa: E402
from pagedserve.kernels.triton.gemm import interpreting  # noqa: E402
from pagedserve.kernels.triton.moe import fused_moe_triton  # noqa: E402
from pagedserve.kernels.triton.paged_attention import paged_attention_triton  # noqa: E402

if not torch.cuda.is_available() and not interpreting():
    pytest.skip("no CUDA and the kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

pytestmark = pytest.mark.bit_exact("triton")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def mma_like_dot(monkeypatch):
    use_row_uniform_dot(monkeypatch)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_is_f_linear_and_each_row_is_the_same_in_any_batch(dtype):
    """x @ W^T + b at a shape no tile divides (K 200, N 150); then each of the first 70 rows alone
    (the first row of its tile) gives the bits it has at its place among 130 rows, as do rows 3 and
    40 first among 7 and 70."""
    w, b = randn(150, 200, dtype=dtype, seed=1) * 0.1, randn(150, dtype=dtype, seed=2)
    x = randn(130, 200, dtype=dtype, seed=3)
    out = bi.matmul(x, w, b)
    assert out.dtype == dtype and out.shape == (130, 150)
    assert rel_err(out, torch.nn.functional.linear(x.float(), w.float(), b.float())) < TOL[dtype]
    differs = [i for i in range(70) if not torch.equal(bi.matmul(x[i: i + 1], w, b)[0], out[i])]
    assert not differs, f"rows {differs} differ alone and among 130"
    for rows in (7, 70):
        for i in (3, 40):
            assert torch.equal(bi.matmul(x[i: i + rows], w, b)[0], out[i])
    assert bi.matmul(x[:0], w).shape == (0, 150)
    assert bi.matmul(x[:5].view(5, 1, 200), w).shape == (5, 1, 150)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("order", ["llama", "rounds once", "offset"])
def test_rms_norm_rounds_as_the_model_s_norm(dtype, order):
    """backend/models/llama.py's RMSNorm in its three orders (Llama, OLMo 2, Gemma), at a width that
    is not a power of two, with the torch expression's result dtype."""
    x, w = randn(9, 96, dtype=dtype, seed=4) * 3, randn(96, dtype=dtype, seed=5)
    rounds_once, offset = order == "rounds once", 1.0 if order == "offset" else 0.0
    out = bi.rms_norm(x, w, 1e-6, rounds_once, offset)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (xf * (offset + w.float())).to(dtype) if offset else (w * xf).to(dtype) if rounds_once else w * xf.to(dtype)
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(bi.rms_norm(x[4:5], w, 1e-6, rounds_once, offset)[0], out[4])


def test_log_softmax_is_torch_s_and_keeps_minus_infinity():
    rows = randn(3, 10_000, seed=6) * 5
    rows[1, 7] = float("-inf")
    out, ref = bi.log_softmax(rows), rows.log_softmax(-1)
    finite = torch.isfinite(ref)
    assert (out[finite] - ref[finite]).abs().max() < 1e-5
    assert out[1, 7] == float("-inf")
    assert torch.equal(bi.log_softmax(rows[2:3])[0], out[2])
    with pytest.raises(TypeError, match="float32 rows"):
        bi.log_softmax(rows.to(torch.bfloat16))


@pytest.mark.parametrize("window", [None, 37, 200])
def test_attention_is_the_same_alone_beside_others_and_chunked(window):
    """A 64-token prompt chunk after 900 keys and a decode at 2,500 keys give the same bits in a mixed
    batch of six sequences, alone, and (the chunk) cut into 40 + 24 tokens; a sliding window starts
    each q-block's keys at a tile boundary, so the cut falls in the same tiles (a window of 200 spans
    two tiles of keys wherever the q-block starts)."""
    q_lens, seq_lens = [1, 64, 1, 17, 300, 1], [700, 964, 2500, 417, 300, 33]
    b = Batch(q_lens, seq_lens, 8, 2, 64, dtype=torch.bfloat16, seed=7)
    attend = dict(window=window, batch_invariant=True)
    whole = b.run(paged_attention_triton, **attend)
    ref = paged_attention_triton(*b.args(), window=window, num_splits=1)
    assert rel_err(whole, ref) < TOL[torch.bfloat16]
    for i in (1, 2):
        assert torch.equal(paged_attention_triton(*b.one_sequence(i), **attend), whole[b.rows_of(i)])
    chunks = [paged_attention_triton(*b.one_sequence(1, lo, hi), **attend) for lo, hi in ((0, 40), (40, 64))]
    assert torch.equal(torch.cat(chunks), whole[b.rows_of(1)])
    with pytest.raises(ValueError, match="num_splits=1"):
        paged_attention_triton(*b.args(), batch_invariant=True, num_splits=4)


def test_moe_token_is_the_same_alone_and_in_a_batch():
    """The fused experts' fixed-tile launch: within the kernel's bound of the reference, and token 5's
    output the same bits among 1, 3 and 40 tokens (its experts summed in order)."""
    weights = experts(8, 64, 96, torch.bfloat16, seed=8)
    x = randn(40, 64, dtype=torch.bfloat16, seed=9)
    topk_weights, topk_ids = route(randn(40, 8, seed=10), 3, True, False)
    out = fused_moe_triton(x, weights, topk_weights, topk_ids, batch_invariant=True)
    assert rel_err(out, fused_moe_ref(x, weights, topk_weights, topk_ids)) < MOE_TOL[torch.bfloat16]
    for lo, hi in ((5, 6), (4, 7)):
        part = fused_moe_triton(x[lo:hi], weights, topk_weights[lo:hi], topk_ids[lo:hi], batch_invariant=True)
        assert torch.equal(part[5 - lo], out[5])
