"""Decode steps as whole CUDA graphs: one launch replays every kernel of a step.

A decode step of an 8B model is little GPU work split over ~400 kernels (norms,
projections, rotary, the paged attention and the cache write of each layer, the LM head).
Launched one by one from Python they cost more host time than the GPU spends; captured
once per batch-size bucket and replayed, the host pays one launch. What makes a step
capturable is that nothing in it depends on host values that change: the inputs live in
static device buffers (written by two copies from pinned host memory before each replay),
the attention's split over the KV length is chosen for the longest context the engine
allows (its kernel sizes the splits from each sequence's real length), and padding rows
write no KV (slot -1) and attend over one key.

Steps with prompt tokens (prefill chunks, mixed steps) run the model piecewise as before:
their rows change every step and their GPU work dwarfs the launches. Quantized models are
captured too (their Triton GEMMs picked their tiles in the warm-up before capture).

Speculative decoding's verify steps (a sequence's last token and its drafts) have graphs of their
own, with `query_len` = 1 + num_speculative_tokens rows a sequence: a sequence with fewer drafts
fills the rest of its rows with padding that writes no KV and whose logits nobody reads, so one
graph per batch size serves every mix of draft lengths (the rows cost little beside the launches
they spare at the small batches where drafting pays). An EAGLE-3 target's graphs also write the
layers' states its head reads (the model's aux_hidden), handed on in the batch's order.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from .attention import AttentionMetadata
from .multimodal.inputs import rotary_positions

logger = logging.getLogger("pagedserve")


def decode_graphs_wanted(config, device: torch.device) -> bool:
    """On CUDA with one rank, unless `compile: off` asks for a plain eager step."""
    return device.type == "cuda" and config.compile != "off" and config.tensor_parallel_size == 1


SHORT_CONTEXT = 511
"""Decode batches of up to SHORT_BATCH sequences whose contexts are all at most this long
replay a graph captured for such contexts: the attention then runs without its split over
the keys (kernels/triton/paged_attention.py splits from 512 keys, 2 x MIN_KEYS_PER_SPLIT),
one kernel a layer fewer. Longer contexts replay the graph captured for max_model_len."""
SHORT_BATCH = 64
"""Larger batches fill the GPU without splitting the keys anyway: one graph each."""


def graph_sizes(max_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to max_seqs (as vLLM)."""
    sizes = [s for s in (1, 2, 4) if s < max_seqs] + list(range(8, max_seqs + 8, 8))
    return sorted({min(s, max_seqs) for s in sizes})


VERIFY_MAX_SEQS = 32
"""Verify steps of up to this many sequences replay a graph (drafting pays at small batches; each
graph's logits hold query_len rows a sequence)."""


class DecodeGraphs:
    """The captured decode (or verify) steps of one model runner and their static input buffers."""

    def __init__(self, runner, max_seqs: int, max_model_len: int, query_len: int = 1):
        """query_len: rows a sequence, 1 for decode steps, 1 + num_speculative_tokens for verify steps."""
        self.runner = runner
        self.device = runner.device
        self.sizes = graph_sizes(max_seqs)
        self.max_seqs = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.query_len = q = query_len
        n = self.max_seqs
        self.captures = self.device.type == "cuda"
        """Off CUDA (the tests' CPU check of the buffers' layout) each size runs eagerly over the same buffers."""
        # Per step: int64 [ids | positions | slots] (q rows a sequence) and int32 [seq_lens |
        # query_start], two host sets used in turn (a step's copy may still be reading one while
        # the next step, async scheduling, writes the other), and the block-table rows that changed.
        pin = self.captures
        self.hosts = [(torch.zeros(3 * n * q, dtype=torch.int64, pin_memory=pin),
                       torch.zeros(2 * n + 1, dtype=torch.int32, pin_memory=pin),
                       torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=pin),
                       torch.zeros(n, dtype=torch.int64, pin_memory=pin))
                      for _ in range(2)]
        self.turn = 0
        self.step_starts = np.arange(n + 1, dtype=np.int64)
        """query_start of a decode step: one token a sequence."""
        self.dev64 = torch.zeros(3 * n * q, dtype=torch.int64, device=self.device)
        self.dev32 = torch.zeros(2 * n + 1, dtype=torch.int32, device=self.device)
        self.dev_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=self.device)
        # The persistent batch: each running sequence keeps its row (0..k-1 for k sequences),
        # and its block table lives on the device, where a step writes only the rows that
        # changed (new blocks, a sequence new to its row).
        self.row_of: dict[int, int] = {}  # id(seq) -> row
        self.row_seqs: list = []  # row -> seq
        self.tables = np.zeros((n, self.max_blocks), dtype=np.int32)  # host copy of dev_tables
        self.table_lens = np.zeros(n, dtype=np.int64)  # block ids of each row on the device
        self.table_lists: list = [None] * n  # the block_table list each row's ids came from
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        """By (batch size, longest context captured for)."""
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.aux: dict[tuple[int, int], torch.Tensor] = {}
        """An EAGLE-3 target's kept states (its model's aux_hidden) each graph writes, by key."""

    # -- views of the static buffers --------------------------------------------------
    def _views(self, rows: int):
        """The buffers of a step of `rows` sequences (rows x query_len tokens)."""
        n, tokens, width = self.max_seqs, rows * self.query_len, self.max_seqs * self.query_len
        ids, positions = self.dev64[:tokens], self.dev64[width : width + tokens]
        slots = self.dev64[2 * width : 2 * width + tokens]
        seq_lens, query_start = self.dev32[:rows], self.dev32[n : n + rows + 1]
        return ids, positions, slots, seq_lens, query_start, self.dev_tables[:rows]

    def takes(self, batch) -> bool:
        """A committed step in which every sequence samples: one decoded token each (query_len 1),
        or (verify graphs) its known last token and at most query_len - 1 drafts, within the context."""
        if not (bool(self.graphs) and 0 < len(batch.seqs) <= self.max_seqs and len(batch.sampling_seqs) == len(batch.seqs)):
            return False
        if self.query_len == 1:
            return sum(batch.num_new_tokens) == len(batch.seqs)
        q = self.query_len
        return batch.has_drafts and all(
            count == 1 + len(drafts) <= q and start < len(seq.token_ids) and start + q <= self.max_model_len
            for seq, start, count, drafts in zip(batch.seqs, batch.starts, batch.num_new_tokens, batch.drafts))

    def bucket(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch size, context) captured, largest first."""
        keys = [(size, self.max_model_len) for size in self.sizes]
        if self.max_model_len > SHORT_CONTEXT:
            keys += [(size, SHORT_CONTEXT) for size in self.sizes if size <= SHORT_BATCH]
        return sorted(keys, reverse=True)

    def key(self, rows: int, longest: int) -> tuple[int, int]:
        size = self.bucket(rows)
        short = (size, SHORT_CONTEXT)
        return short if longest <= SHORT_CONTEXT and short in self.graphs else (size, self.max_model_len)

    # -- capture ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up (Triton compiles and picks tiles outside the capture), then
        capture each, largest first, all in one memory pool."""
        started = time.perf_counter()
        self._write_padding()
        if not self.captures:
            self.graphs = dict.fromkeys(self.keys())
            return
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for key in self.keys():
            self._forward(*key)  # warm-up, outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            if getattr(self.runner.model, "aux_layers", ()):
                self.aux[key] = self.runner.model.aux_hidden
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        logger.info("decode CUDA graphs captured in %.1fs: %d batch sizes up to %d (%d graphs)",
                    time.perf_counter() - started, len(self.sizes), self.max_seqs, len(self.graphs))

    def _forward(self, rows: int, context: int) -> torch.Tensor:
        ids, positions, slots, seq_lens, query_start, tables = self._views(rows)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                 query_start_loc=query_start, max_query_len=self.query_len, max_seq_len=context)
        runner = self.runner
        pieces = runner.compiled.pieces if runner.compiled else None
        hidden = runner.model(ids, positions, runner.kv_caches, meta, runner.attention_kernels, pieces, None)
        return runner.model.compute_logits(hidden)

    def _write_padding(self) -> None:
        """Every row as padding, on the host and the device: token 0 at position 0, no KV
        written (slot -1), query_len keys read (block table rows keep valid ids: zeros here,
        whatever a step wrote later)."""
        n, q = self.max_seqs, self.query_len
        for host64, host32, _, _ in self.hosts:
            host64[: 2 * n * q] = 0
            host64[2 * n * q :] = -1
            host32[:n] = q
            host32[n:] = torch.arange(n + 1, dtype=torch.int32) * q
        self.dev64.copy_(self.hosts[0][0])
        self.dev32.copy_(self.hosts[0][1])

    # -- the persistent batch -------------------------------------------------------------
    def _rows(self, seqs: list) -> np.ndarray:
        """Each sequence's row: kept from the step before where it had one; a sequence gone
        frees its row, and the last rows move into the holes so that k sequences hold rows
        0..k-1 (the graph of a batch size runs over its first rows)."""
        keep = {id(seq) for seq in seqs}
        if len(self.row_of) != len(seqs) or any(id(seq) not in self.row_of for seq in seqs):
            survivors = [seq for seq in self.row_seqs if id(seq) in keep]
            moved = {id(seq) for seq in survivors}
            rows = [None] * len(seqs)
            for seq in survivors:  # compact, keeping each survivor's row where it fits
                row = self.row_of[id(seq)]
                if row < len(seqs) and rows[row] is None:
                    rows[row] = seq
            placed = {id(seq) for seq in rows if seq is not None}
            waiting = [seq for seq in survivors if id(seq) not in placed] + [seq for seq in seqs if id(seq) not in moved]
            for row in range(len(seqs)):
                if rows[row] is None:
                    rows[row] = waiting.pop(0)
                    self.table_lists[row] = None  # its block table uploads whole
            self.row_seqs = rows
            self.row_of = {id(seq): row for row, seq in enumerate(rows)}
        return np.fromiter((self.row_of[id(seq)] for seq in seqs), dtype=np.int64, count=len(seqs))

    def _update_tables(self, seqs: list, rows: np.ndarray, staged: torch.Tensor, staged_rows: torch.Tensor) -> None:
        """Write the block-table rows that changed to the device: new blocks at the end of a
        sequence's table, or a whole row where the row changed hands or the sequence's
        table was rebuilt (preemption)."""
        changed = 0
        host = staged.numpy()
        for seq, row in zip(seqs, rows.tolist()):
            table = seq.block_table
            done = self.table_lens[row] if self.table_lists[row] is table else 0
            if len(table) > done:
                self.tables[row, done : len(table)] = table[done:]
                self.table_lens[row], self.table_lists[row] = len(table), table
                host[changed] = self.tables[row]
                staged_rows[changed] = row
                changed += 1
        if changed:
            rows_on_device = staged_rows[:changed].to(self.device, non_blocking=True)
            self.dev_tables.index_copy_(0, rows_on_device, staged[:changed].to(self.device, non_blocking=True))

    # -- replay -------------------------------------------------------------------------
    def run(self, batch) -> tuple[torch.Tensor, list]:
        """Logits [k, vocab] float32 of a decode step of k sequences (a view of the graph's
        output, valid until the next replay) and the sequences in the order of its rows; a verify
        step's: each sequence's 1 + drafts rows, sequence after sequence in that order."""
        seqs, starts = batch.seqs, np.asarray(batch.starts, dtype=np.int64)
        k = len(seqs)
        rows = self._rows(seqs)
        key = self.key(k, int(starts.max()) + self.query_len)
        size, n, bs = key[0], self.max_seqs, self.runner.block_size
        host64, host32, staged, staged_rows = self.hosts[self.turn]
        self.turn ^= 1
        self._update_tables(seqs, rows, staged, staged_rows)
        h64, h32 = host64.numpy(), host32.numpy()
        if self.query_len > 1:
            return self._run_verify(batch, rows, starts, key, h64, h32, host64, host32)
        device_rows, device_src = [], []
        last_rows = self.runner.last_rows
        for seq, row, start in zip(seqs, rows.tolist(), batch.starts):
            if start < len(seq.token_ids):
                h64[row] = seq.token_ids[start]
            else:  # sampled by the step before, still on the device
                device_rows.append(row)
                device_src.append(last_rows[id(seq)])
        h64[n + rows] = rotary_positions(seqs, starts, self.step_starts[: k + 1])  # Qwen2.5-VL: shifted
        h64[2 * n + rows] = self.tables[rows, starts // bs].astype(np.int64) * bs + starts % bs
        h64[2 * n + k : 2 * n + size] = -1  # padding rows write no KV
        h32[rows] = starts + 1
        h32[k:size] = 1
        self.dev64.copy_(host64, non_blocking=True)
        self.dev32.copy_(host32, non_blocking=True)
        self.runner.fill_device_tokens(self.dev64[:k], np.asarray(device_rows, dtype=np.int64),
                                       np.asarray(device_src, dtype=np.int64))
        logits = self._replay(key)
        self._keep_aux(key, rows)
        return logits[:k], self.row_seqs

    def _run_verify(self, batch, rows: np.ndarray, starts: np.ndarray, key: tuple[int, int], h64: np.ndarray,
                    h32: np.ndarray, host64: torch.Tensor, host32: torch.Tensor) -> tuple[torch.Tensor, list]:
        """A verify step's rows: sequence r's inputs in rows r*q .. r*q + drafts (its last token,
        then its drafts), the rest of its q rows padding (no KV written; the sequence counted q
        tokens long, so each real row sees exactly its own causal context)."""
        q, n, bs, k = self.query_len, self.max_seqs, self.runner.block_size, len(batch.seqs)
        width, size = n * q, key[0]
        h64[: k * q] = 0
        h64[2 * width : 2 * width + size * q] = -1
        counts = np.asarray(batch.num_new_tokens, dtype=np.int64)  # 1 + drafts each (takes)
        for seq, row, start, drafts, count in zip(batch.seqs, rows.tolist(), starts.tolist(), batch.drafts, counts.tolist()):
            first = row * q
            h64[first] = seq.token_ids[start]
            h64[first + 1 : first + count] = drafts
            positions = np.arange(start, start + q, dtype=np.int64)
            h64[width + first : width + first + q] = rotary_positions([seq], positions, self.step_starts[:2] * q)
            real = positions[:count]
            h64[2 * width + first : 2 * width + first + count] = self.tables[row, real // bs].astype(np.int64) * bs + real % bs
            h32[row] = start + q
        h32[k:size] = q
        self.dev64.copy_(host64, non_blocking=True)
        self.dev32.copy_(host32, non_blocking=True)
        by_row = np.empty(k, dtype=np.int64)
        by_row[rows] = counts
        index = _real_rows(np.arange(k) * q, by_row)  # rows 0..k-1 hold the step's k sequences
        logits = self._replay(key).index_select(0, torch.from_numpy(index).to(self.device, non_blocking=True))
        self._keep_aux(key, _real_rows(rows * q, counts))
        return logits, self.row_seqs

    def _keep_aux(self, key: tuple[int, int], index: np.ndarray) -> None:
        """An EAGLE-3 target's kept states of the step's tokens, in the batch's order (the head reads
        them by it; the graph's rows keep their own)."""
        model = self.runner.model
        if getattr(model, "aux_layers", ()):
            states = self.aux[key] if self.graphs[key] is not None else model.aux_hidden
            model.aux_hidden = states.index_select(0, torch.from_numpy(index).to(self.device, non_blocking=True))

    def _replay(self, key: tuple[int, int]) -> torch.Tensor:
        """The logits of every row of the graph `key` over the buffers as they stand."""
        graph = self.graphs[key]
        if graph is None:  # off CUDA: the same buffers, eagerly
            return self._forward(*key)
        graph.replay()
        return self.outputs[key]


def _real_rows(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows firsts[i] .. firsts[i] + counts[i] - 1 of each sequence i, in that order."""
    return np.concatenate([np.arange(first, first + count) for first, count in zip(firsts.tolist(), counts.tolist())])
