"""A random ragged flat batch over a paged KV cache, shared by the paged-attention tests
(tests/kernels/test_paged_attention.py: Triton kernel; test_paged_attention_cpu.py: CPU
attention), each checked against the torch reference `paged_attention_ref`.

Error metric: max |out - ref| / max |ref| over the whole output; TOL holds the bounds per
query dtype (both sides round in bfloat16 / float16).

The caches an implementation under test reads hold NaN in every slot that is not a real
token, and its block tables pad with an all-NaN block, so reading past a sequence's end
or following a padding entry shows up as NaN. The reference (which itself reads masked
padding) gets the same data with finite poison instead.
"""

from __future__ import annotations

import math

import torch

from pagedserve.kernels.cache_write import write_kv_cache_ref
from pagedserve.kernels.numerics import cdiv
from pagedserve.kernels.paged_attention import paged_attention_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
K_POISON, V_POISON = 30.0, 400.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output (unwritten or corrupted rows)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


class Batch:
    """A flat batch: sequence i has q_lens[i] new tokens at the end of seq_lens[i] tokens of context.

    Blocks are drawn at random from a pool `spread` times larger than needed (shuffled,
    non-contiguous, high ids). The kernel's caches hold NaN in every slot that is not
    a real token (tails of last blocks, unused blocks) and its block tables pad with
    the id of an all-NaN block: a kernel that reads past a sequence's end or follows a
    padding entry produces NaN. The reference (which itself reads masked padding) gets
    the same data with finite poison instead. kf/vf: the full-precision float32 K/V."""

    def __init__(
        self,
        q_lens: list[int],
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
        spread: int = 3,
        seed: int = 0,
        device: torch.device = DEVICE,
        kv_std: float = 1.0,
    ):
        assert all(0 < q <= s for q, s in zip(q_lens, seq_lens))
        g = torch.Generator().manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        blocks_per_seq = [cdiv(s, block_size) for s in seq_lens]
        needed = sum(blocks_per_seq)
        num_blocks = needed * spread + 2
        ids = torch.randperm(num_blocks, generator=g)
        nan_block, poison_block = int(ids[-1]), int(ids[-2])
        max_blocks = max(blocks_per_seq) + 3  # padding entries past every sequence's end
        table = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
        kernel_table = torch.full_like(table, nan_block)
        used = ids[:needed].tolist()
        kf = torch.full((num_blocks, block_size, num_kv_heads, head_dim), K_POISON)
        vf = torch.full_like(kf, V_POISON)
        real = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for i, (s, n) in enumerate(zip(seq_lens, blocks_per_seq)):
            mine, used = used[:n], used[n:]
            table[i, :n] = kernel_table[i, :n] = torch.tensor(mine, dtype=torch.int32)
            for j, b in enumerate(mine):
                valid = min(block_size, s - j * block_size)
                kf[b, :valid] = torch.randn(valid, num_kv_heads, head_dim, generator=g) * kv_std
                vf[b, :valid] = torch.randn(valid, num_kv_heads, head_dim, generator=g) * kv_std
                real[b, :valid] = True
        self.kf, self.vf = kf.to(device), vf.to(device)
        self.k_scale = self.v_scale = None
        if kv_dtype == FP8:
            # per-tensor scales as a calibrator would pick them (amax of the real tokens / 448)
            self.k_scale = float(kf[real].abs().amax()) / 448.0
            self.v_scale = float(vf[real].abs().amax()) / 448.0
            self.ref_key_cache = torch.empty(kf.shape, dtype=FP8, device=device)
            self.ref_value_cache = torch.empty_like(self.ref_key_cache)
            slots = torch.arange(kf.shape[0] * block_size, device=device)
            flat = (-1, num_kv_heads, head_dim)
            write_kv_cache_ref(
                self.kf.view(flat), self.vf.view(flat), self.ref_key_cache, self.ref_value_cache, slots,
                k_scale=self.k_scale, v_scale=self.v_scale,
            )
        else:
            self.ref_key_cache, self.ref_value_cache = self.kf.to(kv_dtype), self.vf.to(kv_dtype)
        self.key_cache, self.value_cache = self.ref_key_cache.clone(), self.ref_value_cache.clone()
        not_real = ~real.to(device)
        for cache in (self.key_cache, self.value_cache):
            if kv_dtype == FP8:
                cache.view(torch.uint8)[not_real] = 0x7F  # e4m3fn NaN
            else:
                cache[not_real] = float("nan")
        self.query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device=device, dtype=dtype)
        self.ref_block_tables = table.to(device)
        self.block_tables = kernel_table.to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.scale = 1.0 / math.sqrt(head_dim)

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def ref_args(self) -> tuple:
        return (self.query, self.ref_key_cache, self.ref_value_cache, self.ref_block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def one_sequence(self, i: int, q_from: int = 0, q_to: int | None = None) -> tuple:
        """`args()` for sequence i alone, or for only its new tokens [q_from, q_to): an earlier chunk
        of its prompt, whose context ends at that chunk's last token (the batch-invariance tests)."""
        starts, lens = self.query_start_loc.tolist(), self.seq_lens.tolist()
        q_len = starts[i + 1] - starts[i]
        q_to = q_len if q_to is None else q_to
        dev = self.query.device
        return (self.query[starts[i] + q_from: starts[i] + q_to], self.key_cache, self.value_cache,
                self.block_tables[i: i + 1], torch.tensor([lens[i] - (q_len - q_to)], dtype=torch.int32, device=dev),
                torch.tensor([0, q_to - q_from], dtype=torch.int32, device=dev), self.scale)

    def rows_of(self, i: int) -> slice:
        """Sequence i's rows of the flat batch."""
        starts = self.query_start_loc.tolist()
        return slice(starts[i], starts[i + 1])

    def reference(self) -> torch.Tensor:
        return paged_attention_ref(*self.ref_args(), **self.scales())

    def run(self, attend, **kwargs) -> torch.Tensor:
        """An implementation under test on the NaN-poisoned cache and tables."""
        return attend(*self.args(), **self.scales(), **kwargs)
