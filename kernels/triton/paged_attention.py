"""Triton paged attention: one kernel for a flat batch of prefill chunks and decodes.

Same signature and layout as `paged_attention_ref` (kernels/paged_attention.py).
Kept as one module past 300 lines: the two kernels, the split-KV heuristic and the
launcher share one tiling contract (BLOCK_Q/BLOCK_N/NUM_SPLITS, the partials'
layout), which reads and changes as a unit.

Work decomposition. A program owns (q-block, kv head[, KV split]). A q-block is
BLOCK_Q consecutive new tokens of ONE sequence; its tile rows are those tokens x
the GROUP query heads that share the kv head (rows = BLOCK_Q * GROUP_PAD, token
major), so each K/V tile is loaded once for the whole head group (GQA) and the
QK^T / PV products are real matrix products even for single-token decodes.
The grid has num_tokens // BLOCK_Q + num_seqs q-blocks, an upper bound on
sum(cdiv(q_len, BLOCK_Q)) that needs no host sync; each program finds its
sequence by binary search over query_start_loc (sequence i's q-blocks start at
query_start_loc[i] // BLOCK_Q + i) and surplus programs exit at once.

Keys are read through the block table per key (physical block of key n is
block_tables[seq, n // block_size]), so BLOCK_N may be any power of two,
independent of the cache block size. Pointer offsets into the caches are int64.
Softmax is online (running max / sum) in float32 in the log2 domain.

Soft-capping (constexpr SOFTCAP, Gemma 2): a score in the log2 domain, s * log2(e), is capped at
softcap * log2(e) with the same tanh, which is softcap * tanh(s / softcap) * log2(e).

Attention sinks (constexpr SINKS, gpt-oss): the running max and sum of every row start at its
head's sink logit (log2 domain) and 1 instead of -inf and 0: the sink is a key with no value,
seen first. With split-KV only split 0 starts so, so the merge counts it once.

Sliding window (constexpr SLIDING; the window a runtime int, so one compiled variant serves
every window size): a q-block's key range starts at its first token's window, and each row
masks the keys before its own (query at p sees p - window < n <= p).

Split-KV (flash-decoding): when the batch is too small to fill the device and
the context is long, the key range of every q-block is cut into NUM_SPLITS
tile-aligned segments, the kernel writes unnormalised partials (acc, max, sum)
and `_split_reduce_kernel` merges them. Same kernel, NUM_SPLITS is a constexpr.

FP8 KV (float8_e4m3fn): caches are passed as uint8 views. Where the GPU has
e4m3 in hardware (compute capability >= 8.9, `triton/e4m3.py`'s `native_fp8`) the
bytes are bitcast to tl.float8e4nv and converted by the hardware (works the
same under TRITON_INTERPRET=1, whose fp8 -> fp32 conversion is exact); before
sm_89 (A100), where Triton refuses that type, they are decoded with integer
ops (`triton/e4m3.py`'s `decode_e4m3`, exact too). The launcher picks one from the
device's compute capability: constexpr KV_FP8 = 0 (cache in the query dtype),
1 (e4m3, hardware conversion) or 2 (e4m3, decoded in software). k_scale is
folded into the softmax scale and v_scale into the final normalisation, so
dequant is a plain type conversion.

Interpreter (TRITON_INTERPRET=1, CPU): the interpreter's tl.dot multiplies the
raw uint16 bits of bfloat16 operands, so there the dot operands are upcast to
float32 (DOT_FP32); compiled on a GPU they stay in the query dtype (tensor
cores), with the probabilities cast to that dtype for PV as usual.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ..numerics import cdiv
from ..paged_attention import is_fp8, kv_scales
from .e4m3 import e4m3_to_float, native_fp8

LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    """Whether the kernels of this module were built by the interpreter: decided when
    they were decorated (TRITON_INTERPRET at import time), not by the environment now."""
    return not isinstance(_paged_attention_kernel, JITFunction)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= pid."""
    lo = tl.zeros_like(pid)  # tensors from the start: loop-carried types must not change
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, num_heads,
    qk_scale,  # softmax scale * k_scale * log2(e)
    v_scale,
    window,  # keys a query sees, its own included (SLIDING)
    softcap,  # the soft cap times log2(e) (SOFTCAP), the scores being in the log2 domain
    sinks_ptr,  # float [num_heads]: each head's sink logit (SINKS)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: cache in the query dtype; 1: e4m3, hardware conversion; 2: e4m3 in software
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys before the first new token

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # token index within the sequence
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    last_key = context + tok  # inclusive causal limit of each row

    # Keys this q-block can see: [0, context + its last token + 1), with a sliding window
    # from the tile holding its first token's window start on (the rows' masks cut the rest). The
    # tiles start at multiples of BLOCK_N whatever the q-block, so a query's keys fall in the same
    # tiles however its prompt was cut into chunks (the batch-invariant launch relies on it).
    kv_end = context + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    kv_first = kv_end * 0
    if SLIDING:
        kv_first = tl.maximum(context + q_block * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    if NUM_SPLITS == 1:
        kv_lo = kv_first
        kv_hi = kv_end
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_first, BLOCK_N), NUM_SPLITS)
        kv_lo = kv_first + split * tiles_per_split * BLOCK_N
        kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * BLOCK_N)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        if split == 0:  # the sink is one more logit with no value, counted in the first split only
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        block = tl.load(table_row + n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = (n % KV_BLOCK_SIZE).to(tl.int64)
        kv_mask = n_ok[None, :] & d_ok[:, None]
        # K tile loaded transposed: [HEAD_DIM_PAD, BLOCK_N]
        k = tl.load(k_head + (block * stride_kb + offset * stride_ks)[None, :] + d[:, None], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = e4m3_to_float(k, KV_FP8 == 1)
        k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1): finite at any |x|
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = n_ok[None, :] & (n[None, :] <= last_key[:, None])
        if SLIDING:
            visible = visible & (n[None, :] > last_key[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(v_head + (block * stride_vb + offset * stride_vs)[:, None] + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:
            v = e4m3_to_float(v, KV_FP8 == 1)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc * (v_scale / l_safe)[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = ((q_start + tok).to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _split_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    num_heads, v_scale,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s  (M = max_s m_s)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    part = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + part)
    l = tl.load(part_l_ptr + part)  # noqa: E741 - the docstring's (and flash attention's) m and l
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :])
    o = tl.sum(acc * w[:, None], 0) * (v_scale / tl.where(denom == 0.0, 1.0, denom))
    o_ptr = out_ptr + token.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(o_ptr + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# Host side

MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: a nominal count for the heuristic's arithmetic


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int, block_n: int) -> int:
    """Split-KV only when the grid is smaller than the device (small batch) and the
    context is long: aim for ~2 programs per SM, every split >= MIN_KEYS_PER_SPLIT
    keys; a power of two (a constexpr, so few compiled variants)."""
    if num_programs >= num_sms:
        return 1
    by_occupancy = cdiv(2 * num_sms, num_programs)
    by_length = max_seq_len // max(MIN_KEYS_PER_SPLIT, block_n)
    splits = min(by_occupancy, by_length, MAX_SPLITS)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


def _tiles(num_tokens: int, num_seqs: int, group_pad: int, head_dim_pad: int, interpret: bool,
           elem_bytes: int = 2, batch_invariant: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). GPU: 16 rows for decode-dominated batches (the minimum
    tl.dot tile; a decode fills GROUP of them) and always with `batch_invariant` (a row's
    products then take one tl.dot shape whatever the batch), 64 once queries are long, 64 keys; 32
    rows and 32 keys instead when a row of the dot operands (head_dim_pad x elem_bytes,
    the query dtype) exceeds 256 bytes (head_dim > 128 in 16-bit, > 64 in float32), so
    the K/V stages fit shared memory on every target (float32 head 128 at 64 x 64 needs
    112 KiB; sm_89 allows 99, kernels/triton/aot.py); 16 keys past 512 bytes a row (float32 at head
    dim 256, Gemma's: 32 keys needed 100 KiB). The interpreter pays per operation, not
    per element, so it takes big tiles."""
    if interpret:
        return max(64, group_pad), 128
    avg_q = num_tokens / max(num_seqs, 1)
    row_bytes = head_dim_pad * elem_bytes
    wide = row_bytes > 256
    block_m = 16 if avg_q < 8 or batch_invariant else (32 if wide else 64)
    block_n = 16 if row_bytes > 512 else 32 if wide else 64
    return max(block_m, group_pad), block_n


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Triton twin of `paged_attention_ref` (window: its sliding window, None for full causal;
    softcap: its score soft cap; sinks: each head's sink logit). batch_invariant (`deterministic`):
    tiles that do not depend on the batch and no split over the keys, so each query's output is
    the same whatever else the step holds and however its prompt was chunked.

    Tuning overrides (keyword-only, for tests/benchmarks): num_splits forces the
    split-KV path (1 = off, a power of two); max_seq_len spares the one host
    sync the split heuristic needs (seq_lens.max(), only when the grid is small);
    block_m (rows = tokens x padded head group) and block_n (keys per tile).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, kv_block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if num_heads % num_kv_heads or cache_head_dim != head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not match cache {tuple(key_cache.shape)}")
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    fp8 = is_fp8(key_cache)
    ks, vs = kv_scales(key_cache, k_scale, v_scale)
    if fp8:  # uint8 views: bitcast to fp8 inside the kernel (see module docstring)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim axis must be contiguous")
    block_tables = _int32(block_tables)
    seq_lens = _int32(seq_lens)
    query_start_loc = _int32(query_start_loc)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    interpret = _interpreting()
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    auto_m, auto_n = _tiles(num_tokens, num_seqs, group_pad, head_dim_pad, interpret, query.element_size(),
                            batch_invariant)
    block_m = max(block_m or auto_m, group_pad)
    block_n = block_n or auto_n
    if block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError("block_m and block_n must be powers of two")
    if block_n < 16:
        raise ValueError(f"block_n={block_n}: at least 16 keys a tile (a GPU's smallest tl.dot K)")
    block_q = block_m // group_pad
    num_q_blocks = num_tokens // block_q + num_seqs

    if batch_invariant:
        if num_splits not in (None, 1):
            raise ValueError("batch_invariant attention does not split the keys (num_splits=1)")
        num_splits = 1
    elif num_splits is None:
        programs = num_q_blocks * num_kv_heads
        sms = _num_sms(query.device)
        if programs >= sms:
            num_splits = 1
        else:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            keys_read = max_seq_len if window is None else min(max_seq_len, window + block_q)
            num_splits = choose_num_splits(programs, keys_read, sms, block_n)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError("num_splits must be a power of two")

    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused

    dot_fp32 = interpret or query.dtype == torch.float32
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        query, key_cache, value_cache, out,
        part_acc, part_m, part_l,
        block_tables, seq_lens, query_start_loc,
        num_seqs, num_heads,
        scale * ks * LOG2E, vs,
        window or 0,
        (softcap or 0.0) * LOG2E,
        sinks if sinks is not None else seq_lens,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        KV_BLOCK_SIZE=kv_block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
        SLIDING=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        KV_FP8=(1 if native_fp8(query.device) else 2) if fp8 else 0, DOT_FP32=dot_fp32,
        PRECISION="ieee" if query.dtype == torch.float32 else None,
        num_warps=4 if block_m * head_dim_pad <= 64 * 128 else 8,
        num_stages=2,
    )
    if num_splits > 1:
        _split_reduce_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l,
            num_heads, vs,
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=4,
        )
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


__all__ = ["paged_attention_triton", "choose_num_splits"]
