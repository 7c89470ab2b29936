"""Decode steps as whole CUDA graphs: one launch replays every kernel of a step.

A decode step of an 8B model is ~5 ms of GPU work split over ~400 kernels (norms,
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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionMetadata

logger = logging.getLogger("pagedserve")


def decode_graphs_wanted(config, device: torch.device) -> bool:
    """On CUDA with one rank, unless `compile: off` asks for a plain eager step."""
    return device.type == "cuda" and config.compile != "off" and config.tensor_parallel_size == 1


def graph_sizes(max_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to max_seqs (as vLLM)."""
    sizes = [s for s in (1, 2, 4) if s < max_seqs] + list(range(8, max_seqs + 8, 8))
    return sorted({min(s, max_seqs) for s in sizes})


@dataclass
class StepArrays:
    """One step's inputs on the host (numpy), before any device copy."""

    input_ids: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    slots: np.ndarray  # [tokens] int64
    block_tables: np.ndarray  # [seqs, max_blocks] int32
    seq_lens: np.ndarray  # [seqs] int64
    query_start: np.ndarray  # [seqs + 1] int64
    logits_indices: np.ndarray  # [sampling seqs] int64
    sampling_seqs: list
    device_rows: np.ndarray  # [k] int64: input rows whose token is still on the device
    device_src: np.ndarray  # [k] int64: its row in the step before's sampled tokens

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token and samples it."""
        return len(self.input_ids) == len(self.seq_lens) == len(self.logits_indices)


class DecodeGraphs:
    """The captured decode steps of one model runner and their static input buffers."""

    def __init__(self, runner, max_seqs: int, max_model_len: int):
        self.runner = runner
        self.device = runner.device
        self.sizes = graph_sizes(max_seqs)
        self.max_seqs = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // runner.block_size)
        n = self.max_seqs
        self.captures = self.device.type == "cuda"
        """Off CUDA (the tests' CPU check of the buffers' layout) each size runs eagerly over the same buffers."""
        # int64 inputs [ids | positions | slots] and int32 ones [seq_lens | query_start | block tables];
        # two host sets, used in turn: a step's copy may still be reading one while the next
        # step (async scheduling) writes the other
        self.hosts = [(torch.zeros(3 * n, dtype=torch.int64, pin_memory=self.captures),
                       torch.zeros(2 * n + 1 + n * self.max_blocks, dtype=torch.int32, pin_memory=self.captures))
                      for _ in range(2)]
        self.turn = 0
        self.dev64 = torch.zeros_like(self.hosts[0][0], device=self.device)
        self.dev32 = torch.zeros_like(self.hosts[0][1], device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # -- views of the static buffers --------------------------------------------------
    def _views(self, buffer64: torch.Tensor, buffer32: torch.Tensor, rows: int):
        n = self.max_seqs
        ids, positions, slots = buffer64[:rows], buffer64[n : n + rows], buffer64[2 * n : 2 * n + rows]
        seq_lens, query_start = buffer32[:rows], buffer32[n : n + rows + 1]
        tables = buffer32[2 * n + 1 : 2 * n + 1 + n * self.max_blocks].view(n, self.max_blocks)[:rows]
        return ids, positions, slots, seq_lens, query_start, tables

    def fits(self, arrays: StepArrays) -> bool:
        return arrays.is_decode and len(arrays.seq_lens) <= self.max_seqs and bool(self.graphs)

    def bucket(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    # -- capture ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every size up (Triton compiles and picks tiles outside the capture), then
        capture each, largest first, all in one memory pool."""
        started = time.perf_counter()
        self._write_padding()
        if not self.captures:
            self.graphs = dict.fromkeys(self.sizes)
            return
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up, outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("decode CUDA graphs captured in %.1fs: %d batch sizes up to %d",
                    time.perf_counter() - started, len(self.sizes), self.max_seqs)

    def _forward(self, rows: int) -> torch.Tensor:
        ids, positions, slots, seq_lens, query_start, tables = self._views(self.dev64, self.dev32, rows)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                 query_start_loc=query_start, max_query_len=1, max_seq_len=self.max_model_len)
        runner = self.runner
        pieces = runner.compiled.pieces if runner.compiled else None
        hidden = runner.model(ids, positions, runner.kv_caches, meta, runner.attention_kernels, pieces, None)
        return runner.model.compute_logits(hidden)

    def _write_padding(self) -> None:
        """Every row as padding, on the host and the device: token 0 at position 0, no KV
        written (slot -1), one key read (block table rows keep valid ids: zeros here,
        whatever a step wrote later)."""
        n = self.max_seqs
        for host64, host32 in self.hosts:
            host64[: 2 * n] = 0
            host64[2 * n :] = -1
            host32[:n] = 1
            host32[n : 2 * n + 1] = torch.arange(n + 1, dtype=torch.int32)
        self.dev64.copy_(self.hosts[0][0])
        self.dev32.copy_(self.hosts[0][1])

    # -- replay -------------------------------------------------------------------------
    def run(self, arrays: StepArrays) -> torch.Tensor:
        """Logits [rows, vocab] float32 of a decode step (a view of the graph's output,
        valid until the next replay)."""
        rows = len(arrays.seq_lens)
        size = self.bucket(rows)
        n = self.max_seqs
        host64, host32 = self.hosts[self.turn]
        self.turn ^= 1
        h64, h32 = host64.numpy(), host32.numpy()
        h64[:rows] = arrays.input_ids
        h64[n : n + rows] = arrays.positions
        h64[2 * n : 2 * n + rows] = arrays.slots
        h64[2 * n + rows : 2 * n + size] = -1  # padding rows write no KV
        h32[:rows] = arrays.seq_lens
        h32[rows:size] = 1
        h32[n : n + size + 1] = np.arange(size + 1, dtype=np.int32)
        width = arrays.block_tables.shape[1]
        tables = h32[2 * n + 1 : 2 * n + 1 + n * self.max_blocks].reshape(n, self.max_blocks)
        tables[:rows, :width] = arrays.block_tables
        self.dev64.copy_(host64, non_blocking=True)
        used = 2 * n + 1 + size * self.max_blocks
        self.dev32[:used].copy_(host32[:used], non_blocking=True)
        self.runner.fill_device_tokens(self.dev64[:rows], arrays)
        graph = self.graphs[size]
        if graph is None:
            return self._forward(size)[:rows]
        graph.replay()
        return self.outputs[size][:rows]
