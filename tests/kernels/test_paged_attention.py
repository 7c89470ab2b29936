"""Triton paged attention and cache write vs the torch references.

CPU: the kernels run through the Triton interpreter (TRITON_INTERPRET=1, set in
conftest.py) at small shapes. CUDA: the same tests run compiled, plus the
real-shape tests marked `gpu`. What the compiler (not the interpreter) accepts, per target, is
tests/kernels/test_aot_compile.py's check. Inputs are seeded random normals (never zeros).

Error metric (tests/kernels/paged_batch.py): max |out - ref| / max |ref| over the
whole output. Bounds:
  float32 1e-4; bfloat16 / float16 2e-2 (kernel and reference both round);
  fp8 KV vs the fp8 reference (same quantized cache): float32 query 1e-4,
  bfloat16 query 2e-2 (measured 1.4e-6 and 6e-3);
  fp8 KV vs the unquantized float32 reference: 0.15, and 0.08 in relative
  Frobenius norm (e4m3 keeps 3 mantissa bits, up to 6% per element; with K/V
  std 3 the logits have std ~3 and the softmax is peaked, measured 0.07-0.09
  and 0.05).
Measured on CPU (interpreter): float32 ~2e-7 to 4e-7, bfloat16 ~4e-3 to 5e-3,
float16 ~1.5e-4, split-KV the same as unsplit.
The cache write is checked bit for bit (fp8 included).

The kernel's caches hold NaN in every slot that is not a real token, and its
block tables pad with an all-NaN block, so reading past a sequence's end or
following a padding entry shows up as NaN (see paged_batch.Batch).

One module past 300 lines: the attention, cache-write and dispatch tests share the
device and interpreter setup.
"""

from __future__ import annotations


import pytest
import torch

from pagedserve.kernels.cache_write import write_kv_cache_ref
from pagedserve.kernels.cpu.cache_write import write_kv_cache_cpu
from pagedserve.kernels.numerics import cdiv
from pagedserve.kernels.paged_attention import paged_attention_ref
from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu

from . import paged_batch
from .paged_batch import DEVICE, FP8, TOL, rel_err

CUDA = torch.cuda.is_available()

triton = pytest.importorskip("triton")
from pagedserve.kernels import dispatch  # noqa: E402
from pagedserve.kernels.triton.cache_write import write_kv_cache_triton  # noqa: E402
from pagedserve.kernels.triton.paged_attention import (  # noqa: E402
    _interpreting,
    choose_num_splits,
    paged_attention_triton,
)

if not CUDA and not _interpreting():
    pytest.skip("no CUDA and the kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


class Batch(paged_batch.Batch):
    def triton(self, **kwargs) -> torch.Tensor:
        return self.run(paged_attention_triton, **kwargs)


# q_lens 1..300 in one batch: decodes (short and long context), a full prefill
# (seq_len == q_len), prefix-hit chunks (new tokens after cached context), and a
# 2-token chunk; contexts up to 2500.
MIXED_Q = [1, 300, 1, 1, 17, 1, 64, 2, 1]
MIXED_S = [700, 300, 1, 2500, 417, 33, 64, 1002, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 64), (6, 2, 64), (8, 2, 128)], ids=["mha-d64", "gqa3-d64", "gqa4-d128"]
)
def test_mixed_batch(dtype, num_heads, num_kv_heads, head_dim):
    b = Batch(MIXED_Q, MIXED_S, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=num_heads * 7 + head_dim)
    out = b.triton(num_splits=1)
    assert rel_err(out, b.reference()) < TOL[dtype]


@pytest.mark.parametrize(
    "block_size,block_m,block_n",
    [(16, 16, 16), (16, 16, 64), (32, 64, 16), (32, 32, 16), (8, 16, 128)],
    ids=lambda v: str(v),
)
def test_tiles_and_block_tables(block_size, block_m, block_n):
    """BLOCK_N below, equal to and above the cache block size; BLOCK_M from one
    token of the head group to many; high, shuffled block ids (spread 8)."""
    b = Batch([1, 40, 1, 9, 1], [77, 40, 300, 213, 16], 8, 2, 64, block_size=block_size, spread=8, seed=block_size + block_n)
    assert b.ref_block_tables.max() > 2 * sum(cdiv(s, block_size) for s in [77, 40, 300, 213, 16])
    out = b.triton(num_splits=1, block_m=block_m, block_n=block_n)
    assert rel_err(out, b.reference()) < TOL[torch.float32]


@pytest.mark.parametrize("q_len,context", [(50, 1500), (16, 16 * 40), (33, 1000), (128, 129)])
def test_prefix_hit_chunk(q_len, context):
    """A chunk of new tokens at the end of a longer cached context (prefix-cache hit
    or chunked prefill): causal within the chunk, full attention to the context."""
    b = Batch([q_len, 1], [context, 500], 8, 2, 64, dtype=torch.bfloat16, seed=q_len)
    assert rel_err(b.triton(num_splits=1), b.reference()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_kv(num_splits, dtype):
    """Flash-decoding path: partition each q-block's keys, then reduce. One decode
    with a long context, one short decode (empty splits), one chunk whose rows see
    different key ranges inside a split."""
    b = Batch([1, 1, 20], [3000, 40, 1200], 8, 2, 64, dtype=dtype, seed=num_splits)
    out = b.triton(num_splits=num_splits)
    assert rel_err(out, b.reference()) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_softmax_scale_of_the_model_s_own(num_splits):
    """Granite's attention_multiplier in place of 1/sqrt(head_dim): the scale passed is the one
    applied, unsplit and split."""
    b = Batch([1, 20, 1], [300, 20, 40], 8, 2, 64, seed=5)
    b.scale = 0.3
    assert rel_err(b.triton(num_splits=num_splits), b.reference()) < TOL[torch.float32]


@pytest.mark.parametrize("window,dtype", [(1, torch.float32), (16, torch.bfloat16), (37, torch.float32),
                                          (256, torch.bfloat16)], ids=str)
def test_sliding_window(window, dtype):
    """Mistral / Gemma's local layers: each query sees the last `window` positions only,
    in decodes, fresh prefills and chunks after a cached prefix, windows inside a tile, at
    a tile boundary and longer than some contexts."""
    b = Batch(MIXED_Q, MIXED_S, 8, 2, 64, dtype=dtype, seed=window)
    ref = paged_attention_ref(*b.ref_args(), window=window)
    assert rel_err(b.triton(num_splits=1, window=window), ref) < TOL[dtype]
    assert rel_err(ref, b.reference()) > 0.05  # the window changed the answer


@pytest.mark.parametrize("window", [37, 700])
def test_sliding_window_split(window):
    """Split-KV over the window only: splits share out the keys from the window's start."""
    b = Batch([1, 1, 20], [3000, 40, 1200], 8, 2, 64, seed=window)
    ref = paged_attention_ref(*b.ref_args(), window=window)
    assert rel_err(b.triton(num_splits=4, window=window), ref) < TOL[torch.float32]


@pytest.mark.parametrize("num_splits,dtype", [(1, torch.bfloat16), (4, torch.float32)], ids=str)
def test_soft_capped_scores(num_splits, dtype):
    """Gemma 2's attention soft cap (scores of std ~8 capped at 5, so most are cut), with its sliding
    window and without; split and unsplit."""
    b = Batch([1, 1, 20], [700, 40, 300], 8, 2, 64, dtype=dtype, seed=11)
    b.scale = 1.0
    for window in (None, 100):
        ref = paged_attention_ref(*b.ref_args(), window=window, softcap=5.0)
        assert rel_err(b.triton(num_splits=num_splits, window=window, softcap=5.0), ref) < TOL[dtype]
        assert rel_err(ref, paged_attention_ref(*b.ref_args(), window=window)) > 0.05  # the cap changed the answer


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sink logits of std 2 around 1: on a par with the scores, so they take a real share."""
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2 + 1).to(DEVICE)


def test_attention_sinks_join_each_heads_softmax():
    """The reference with sinks (gpt-oss) against the definition, written out densely per sequence:
    softmax over [scores, sink], the sink's share dropped; a sink at -inf changes nothing."""
    b = Batch([1, 1, 6], [50, 17, 30], 8, 2, 32, seed=5)
    sinks = _sinks(8, 5)
    out = paged_attention_ref(*b.ref_args(), sinks=sinks)
    for i, (start, q_len, seq_len) in enumerate([(0, 1, 50), (1, 1, 17), (2, 6, 30)]):
        blocks = b.ref_block_tables[i, : cdiv(seq_len, 16)].long()
        keys = b.kf[blocks].reshape(-1, 2, 32)[:seq_len].repeat_interleave(4, dim=1)  # [L, heads, d]
        values = b.vf[blocks].reshape(-1, 2, 32)[:seq_len].repeat_interleave(4, dim=1)
        q = b.query[start : start + q_len]
        scores = torch.einsum("qhd,lhd->hql", q, keys) * b.scale
        causal = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(~causal.to(DEVICE), float("-inf"))
        logits = torch.cat((scores, sinks.view(8, 1, 1).expand(8, q_len, 1)), dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        assert rel_err(out[start : start + q_len], torch.einsum("hql,lhd->qhd", probs, values)) < 1e-5
    no_sink = torch.full((8,), float("-inf"), device=DEVICE)
    assert rel_err(paged_attention_ref(*b.ref_args(), sinks=no_sink), b.reference()) < 1e-6
    assert rel_err(out, b.reference()) > 0.05


@pytest.mark.parametrize("num_splits,dtype", [(1, torch.bfloat16), (4, torch.float32)], ids=str)
def test_attention_sinks(num_splits, dtype):
    """gpt-oss's sinks in the Triton kernel and the CPU attention (which takes the reference: the
    poisoned cache is the Triton kernel's test), with its 128-key sliding window and without, split
    (the sink counted once over the splits) and unsplit."""
    b = Batch([1, 1, 20], [700, 40, 300], 8, 2, 64, dtype=dtype, seed=12)
    sinks = _sinks(8, 12)
    for window in (None, 128):
        ref = paged_attention_ref(*b.ref_args(), window=window, sinks=sinks)
        assert rel_err(b.triton(num_splits=num_splits, window=window, sinks=sinks), ref) < TOL[dtype]
        assert rel_err(paged_attention_cpu(*b.ref_args(), window=window, sinks=sinks), ref) < TOL[dtype]  # the reference
        assert rel_err(ref, paged_attention_ref(*b.ref_args(), window=window)) > 0.05


def test_split_heuristic():
    """Small batch + long context splits; a full grid or a short context does not."""
    assert choose_num_splits(num_programs=8, max_seq_len=4096, num_sms=132, block_n=64) > 1
    assert choose_num_splits(num_programs=8, max_seq_len=200, num_sms=132, block_n=64) == 1
    assert choose_num_splits(num_programs=512, max_seq_len=32768, num_sms=132, block_n=64) == 1
    for programs, length in [(1, 100000), (3, 5000), (100, 4096)]:
        n = choose_num_splits(programs, length, 132, 64)
        assert n & (n - 1) == 0 and 1 <= n <= 32
    # End to end with the heuristic choosing (the interpreter's nominal 8 "SMs" also split here).
    b = Batch([1, 1], [2500, 900], 8, 2, 64, seed=5)
    assert rel_err(b.triton(), b.reference()) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_kv(dtype, num_splits):
    """float8_e4m3fn cache with per-tensor scales (kv_std 3 so the scales are not 1)."""
    b = Batch([1, 70, 1, 5], [900, 70, 45, 333], 8, 2, 128, dtype=dtype, kv_dtype=FP8, kv_std=3.0, seed=11)
    assert b.k_scale != 1.0 and b.v_scale != 1.0
    out = b.triton(num_splits=num_splits)
    assert rel_err(out, b.reference()) < TOL[dtype]
    # vs attention over the unquantized cache: the fp8 storage error itself.
    full = paged_attention_ref(b.query.float(), b.kf, b.vf, *b.ref_args()[3:])
    assert rel_err(out.float(), full) < 0.15
    assert ((out.float() - full).norm() / full.norm()).item() < 0.08


def test_fp8_scales_ignored_for_other_dtypes():
    b = Batch([1, 3], [50, 20], 4, 2, 64, seed=3)
    base = b.triton()
    assert torch.equal(paged_attention_triton(*b.args(), k_scale=7.0, v_scale=0.1), base)
    assert torch.equal(paged_attention_ref(*b.ref_args(), k_scale=7.0, v_scale=0.1), b.reference())


def test_head_dim_not_power_of_two():
    b = Batch([1, 12], [100, 30], 4, 2, 80, seed=9)
    assert rel_err(b.triton(), b.reference()) < TOL[torch.float32]


def test_single_sequence_and_empty_batch():
    b = Batch([1], [1], 4, 1, 64, seed=1)
    assert rel_err(b.triton(), b.reference()) < TOL[torch.float32]
    empty = paged_attention_triton(b.query[:0], *b.args()[1:3], b.block_tables[:0], b.seq_lens[:0],
                                   b.query_start_loc[:1], b.scale)
    assert empty.shape == (0, 4, 64)


# ------------------------------------------------------------------------------------ cache write

def _write_case(kv_dtype, src_dtype, *, seed, num_tokens=40, kv_heads=3, head_dim=64, block_size=16, skip_every=5):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 12
    key = (torch.randn(num_tokens, kv_heads, head_dim, generator=g) * 4).to(device=DEVICE, dtype=src_dtype)
    value = (torch.randn(num_tokens, kv_heads, head_dim, generator=g) * 4).to(device=DEVICE, dtype=src_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    slots[::skip_every] = -1  # padding tokens: skipped
    init = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    caches = [init.to(kv_dtype) for _ in range(4)]
    return key, value, slots, caches


@pytest.mark.parametrize(
    "kv_dtype,src_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (FP8, torch.float32), (FP8, torch.bfloat16), (FP8, torch.float16)],
    ids=str,
)
def test_write_kv_cache(kv_dtype, src_dtype):
    seed = [torch.float32, torch.bfloat16, torch.float16, FP8].index(kv_dtype) * 10 + src_dtype.itemsize
    key, value, slots, (k_ref, v_ref, k_tri, v_tri) = _write_case(kv_dtype, src_dtype, seed=seed)
    before = k_tri.clone()
    scales = {"k_scale": 0.02, "v_scale": 0.05} if kv_dtype == FP8 else {}
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, **scales)
    write_kv_cache_triton(key, value, k_tri, v_tri, slots, **scales)
    assert torch.equal(k_tri.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_tri.view(torch.uint8), v_ref.view(torch.uint8))
    # skipped tokens wrote nothing: every slot no kept token maps to is untouched
    kept = slots[slots >= 0]
    untouched = torch.ones(k_tri.shape[0] * k_tri.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[kept] = False
    flat = lambda c: c.view(-1, *c.shape[2:]).view(torch.uint8)  # noqa: E731
    assert torch.equal(flat(k_tri)[untouched], flat(before)[untouched])
    if kv_dtype == FP8:
        # dequantized error: half an e4m3 step, i.e. 2^-4 relative (normals) or 2^-10 * scale (subnormals)
        deq = k_tri.view(-1, *k_tri.shape[2:])[kept].float() * 0.02
        src = key[slots >= 0].float()
        in_range = src.abs() <= 448 * 0.02
        assert in_range.float().mean() > 0.9
        err = (deq - src).abs()[in_range]
        assert (err <= src.abs()[in_range] / 16 + 0.02 * 2.0**-10 + 1e-7).all()
        assert (deq[~in_range].abs() == 448 * 0.02).all()  # saturated, not NaN


def test_fp8_encoding_exhaustive():
    """Every finite e4m3 value, every midpoint between neighbours (ties to even),
    values past the range (saturate to +-448), and tiny ones, through the kernel."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()].unique().sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    extra = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e6, -1e6, 2.0**-10, 2.0**-12, 1e-30, -0.0])
    x = torch.cat([finite, mids, near, extra])
    x = torch.cat([x, torch.zeros((-x.numel()) % 16)]).view(-1, 1, 16).to(DEVICE)
    slots = torch.arange(x.shape[0], device=DEVICE)
    ref_k = torch.empty(x.shape[0], 1, 1, 16, dtype=FP8, device=DEVICE)
    ref_v, tri_k, tri_v = torch.empty_like(ref_k), torch.empty_like(ref_k), torch.empty_like(ref_k)
    write_kv_cache_ref(x, -x, ref_k, ref_v, slots, k_scale=1.0, v_scale=1.0)
    write_kv_cache_triton(x, -x, tri_k, tri_v, slots, k_scale=1.0, v_scale=1.0)
    assert torch.equal(tri_k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(tri_v.view(torch.uint8), ref_v.view(torch.uint8))
    assert tri_k.float().abs().max() == 448.0


# ------------------------------------------------------------------------------------ dispatch

def test_dispatch(monkeypatch):
    from pagedserve.backend.attention import AttentionKernels, select_attention_kernels

    assert dispatch.attention_kernels("triton", DEVICE) == (write_kv_cache_triton, paged_attention_triton)
    assert dispatch.attention_kernels("torch", DEVICE) == (write_kv_cache_ref, paged_attention_ref)
    auto = (write_kv_cache_triton, paged_attention_triton) if CUDA else (write_kv_cache_cpu, paged_attention_cpu)
    assert dispatch.attention_kernels("auto", DEVICE) == auto
    kernels = select_attention_kernels("triton", DEVICE)
    assert isinstance(kernels, AttentionKernels)
    assert kernels.write_cache is write_kv_cache_triton and kernels.attend is paged_attention_triton
    cpu = torch.zeros(1, dtype=torch.bfloat16)
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    assert dispatch.use_triton(cpu) is False
    monkeypatch.setenv(dispatch.FORCE_ENV, "1")
    assert dispatch.use_triton(cpu) is True
    # the Triton GEMMs take 16-bit activations: float32 ones (a float32 engine) run the reference
    assert dispatch.use_triton(cpu.float()) is False


def test_engine_attention_call():
    """backend/attention.attention(): write the step's K/V, then attend, Triton vs torch kernels."""
    from pagedserve.backend.attention import TORCH_KERNELS, AttentionMetadata, LayerKVCache, attention, select_attention_kernels

    b = Batch([1, 6, 1], [60, 6, 20], 4, 2, 64, seed=21)
    g = torch.Generator().manual_seed(22)
    n = b.query.shape[0]
    key = torch.randn(n, 2, 64, generator=g).to(DEVICE)
    value = torch.randn(n, 2, 64, generator=g).to(DEVICE)
    # the new tokens' slots: the last q positions of each sequence
    slots = []
    for i, (q, s) in enumerate(zip([1, 6, 1], [60, 6, 20])):
        for pos in range(s - q, s):
            slots.append(int(b.block_tables[i, pos // 16]) * 16 + pos % 16)
    slots = torch.tensor(slots, device=DEVICE)
    outs = []
    for kernels, k_cache, v_cache, table in (
        (TORCH_KERNELS, b.ref_key_cache, b.ref_value_cache, b.ref_block_tables),
        (select_attention_kernels("triton", DEVICE), b.key_cache, b.value_cache, b.block_tables),
    ):
        meta = AttentionMetadata(slots, table, b.seq_lens, b.query_start_loc, max_query_len=6, max_seq_len=60)
        kv = LayerKVCache(k_cache.clone(), v_cache.clone())
        outs.append(attention(kernels, b.query, key, value, kv, meta, b.scale))
    assert rel_err(outs[1], outs[0]) < TOL[torch.float32]


# ------------------------------------------------------------------------------------ GPU, real shapes

LLAMA8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def _llama_batch(dtype, kv_dtype=None, seed=0, n_decode=56, block_size=16):
    g = torch.Generator().manual_seed(seed)
    dec = torch.randint(1, 4097, (n_decode,), generator=g).tolist()
    chunks_q = [512, 300, 128, 77, 1, 200, 64, 33]  # chunked prefill / prefix hits / one more decode
    chunks_s = [512, 2048, 4096, 1000, 3000, 200, 3500, 33]
    return Batch(dec + chunks_q, dec + chunks_s, **LLAMA8B, dtype=dtype, kv_dtype=kv_dtype,
                 block_size=block_size, spread=2, seed=seed, kv_std=2.0 if kv_dtype == FP8 else 1.0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_llama8b_mixed(dtype):
    b = _llama_batch(dtype)
    out = b.triton()
    assert rel_err(out, b.reference()) < TOL[dtype]
    assert rel_err(b.triton(num_splits=8), b.reference()) < TOL[dtype]


@pytest.mark.gpu
@gpu
def test_gpu_llama8b_fp8():
    b = _llama_batch(torch.bfloat16, kv_dtype=FP8, seed=1)
    assert rel_err(b.triton(), b.reference()) < TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_split_kv_long_context(batch):
    b = Batch([1] * batch, [32768 - 7 * i for i in range(batch)], **LLAMA8B, dtype=torch.bfloat16, spread=1, seed=batch)
    programs = (batch // 4 + batch) * 8  # decode tiles: 16 rows = 4 tokens x 4 heads
    assert choose_num_splits(programs, 32768, torch.cuda.get_device_properties(0).multi_processor_count, 64) > 1
    assert rel_err(b.triton(), b.reference()) < TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu
def test_gpu_int64_offsets():
    """Block ids whose element offset exceeds 2^31 (cache > 4 GiB per tensor in bf16)."""
    block_size, kvh, d = 16, 8, 128
    per_block = block_size * kvh * d
    num_blocks = (2**31) // per_block + 4096
    free = torch.cuda.mem_get_info()[0]
    if free < 2.5 * num_blocks * per_block * 2:
        pytest.skip("not enough GPU memory for two >4 GiB caches")
    g = torch.Generator(device="cuda").manual_seed(0)
    key_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)  # the reference reads masked slots too: no NaN garbage
    seq_lens = [3000, 1, 700]
    q_lens = [1, 1, 50]
    high = torch.arange(num_blocks - 1, num_blocks - 1 - 400, -1, device="cuda", dtype=torch.int32)
    table = torch.zeros(3, 200, dtype=torch.int32, device="cuda")
    table[0, :188] = high[:188]
    table[1, :1] = high[188:189]
    table[2, :44] = high[189:233]
    # write the contexts with the Triton write kernel (int64 slots), then compare attention
    slots, keys, values = [], [], []
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s, device="cuda")
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    slots = torch.cat(slots)
    keys = torch.randn(slots.numel(), kvh, d, device="cuda", generator=g, dtype=torch.bfloat16)
    values = torch.randn(slots.numel(), kvh, d, device="cuda", generator=g, dtype=torch.bfloat16)
    write_kv_cache_triton(keys, values, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, kvh, d)[slots], keys)
    query = torch.randn(sum(q_lens), 32, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 1, 2, 52], dtype=torch.int32, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (query, key_cache, value_cache, table, sl, qsl, d**-0.5)
    out = paged_attention_triton(*args)
    ref = paged_attention_ref(*args)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=str)
def test_gpu_write_kv_cache(kv_dtype):
    g = torch.Generator().manual_seed(4)
    n, kvh, d = 4096, 8, 128
    key = torch.randn(n, kvh, d, generator=g).cuda().bfloat16()
    value = torch.randn(n, kvh, d, generator=g).cuda().bfloat16()
    slots = torch.randperm(2048 * 16, generator=g)[:n].cuda()
    slots[::9] = -1
    caches = [torch.zeros(2048, 16, kvh, d, device="cuda").to(kv_dtype) for _ in range(4)]
    scales = {"k_scale": 0.01, "v_scale": 0.02} if kv_dtype == FP8 else {}
    write_kv_cache_ref(key, value, caches[0], caches[1], slots, **scales)
    write_kv_cache_triton(key, value, caches[2], caches[3], slots, **scales)
    for ref, tri in ((caches[0], caches[2]), (caches[1], caches[3])):
        a, b = ref.view(torch.uint8), tri.view(torch.uint8)
        if kv_dtype == FP8:
            # torch on CUDA may divide by the scale as a reciprocal multiply: allow a rare 1-code difference
            diff = (a.int() - b.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        else:
            assert torch.equal(a, b)


def test_bidirectional_spans_see_their_whole_span():
    """visible_until (the torch reference's): rows of a span (an image's tokens) see every key up to
    its end, before and after themselves; other rows stay causal; a later query of the chunk sees the
    span as any earlier keys. Checked against dense attention with that mask, a prefill of 12 new
    tokens on 20 of context, and one whose chunk starts inside the span (its earlier rows cached)."""
    import torch.nn.functional as F

    from .paged_batch import Batch

    for q_len, seq_len, span in ((12, 20, (10, 14)), (6, 20, (12, 17))):
        batch = Batch([q_len], [seq_len], num_heads=4, num_kv_heads=2, head_dim=16, device=torch.device("cpu"))
        own = torch.arange(seq_len - q_len, seq_len)
        until = torch.where((own >= span[0]) & (own < span[1]), span[1] - 1, own).to(torch.int32)
        out = paged_attention_ref(*batch.ref_args(), visible_until=until)
        table = batch.ref_block_tables[0].long()
        keys = batch.ref_key_cache[table].reshape(-1, 2, 16)[:seq_len].transpose(0, 1)
        values = batch.ref_value_cache[table].reshape(-1, 2, 16)[:seq_len].transpose(0, 1)
        positions = torch.arange(seq_len)
        mask = (positions[None, :] <= own[:, None]) | (positions[None, :] <= until[:, None])
        dense = F.scaled_dot_product_attention(batch.query.transpose(0, 1), keys, values, attn_mask=mask,
                                               scale=batch.scale, enable_gqa=True).transpose(0, 1)
        assert torch.allclose(out, dense, atol=1e-5)
        causal = paged_attention_ref(*batch.ref_args())
        inside = (own >= span[0]) & (own < span[1] - 1)
        assert not torch.allclose(out[inside], causal[inside], atol=1e-3)  # the span's rows see more
        assert torch.allclose(out[~inside], causal[~inside], atol=1e-6)
