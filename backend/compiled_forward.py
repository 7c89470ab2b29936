"""The compiled step: the model's work between attentions, compiled once with torch.compile.

Why pieces: the paged attention's layout (which blocks, how many keys per sequence)
changes every step, and its CPU and Triton kernels are already what a compiler would
make of it; everything else in a layer (norms, rotary, projections, SiLU, residuals) is
a chain of small ops whose per-op dispatch dominates a small model's step on CPU and
batch-1 decode on GPU. So the three `ForwardPieces` (embedding -> first attention,
attention -> next attention, last attention -> final norm) are compiled, and the
attention runs eagerly between them, as vLLM's piecewise compilation does.

Each piece takes its layers as arguments, so one compiled graph serves all of them.
Token rows are symbolic (dynamic shapes): one graph covers every token count; torch
specialises a count of 1, so warm-up at load runs 1 and 2 rows of every piece and no
request pays compilation. Where a shape-keyed cache sits under the graph (oneDNN's bf16
kernels on CPU), the runner pads the step's rows to `row_bucket` sizes first and the
warm-up covers every bucket up to the step's token budget.

On CUDA the pieces are plain inductor kernels (no CUDA graphs of inductor's own): decode
steps are captured whole, pieces and attention together, by backend/cuda_graphs.py, and
prompt steps launch the pieces' fused kernels between the attentions.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from pagedserve.kernels.cache_dir import cache_root

from .config import EngineConfig
from .models.linear import row_bucket
from .models.llama import ForwardPieces, LlamaForCausalLM, first_piece, last_piece, middle_piece

logger = logging.getLogger("pagedserve")

RECOMPILE_LIMIT = 64


class CompiledForward:
    """The three pieces compiled for one model; counts its compilations (a recompilation
    after warm-up would mean a request paid for one)."""

    def __init__(self, model: LlamaForCausalLM, device: torch.device):
        # inductor's compiled code, kept across server restarts
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        # torch keeps compiled variants per function, shared by every engine of the process
        # (tests, a server reloading a model): past the limit it would fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.model = model
        self.device = device
        half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        self.pads_rows = device.type == "cpu" and half
        """Rows padded to buckets: oneDNN's kernels are keyed by shape."""
        self.options = {"triton.cudagraphs": False, "emulate_precision_casts": True}
        self.compilations = 0
        self.pieces = ForwardPieces(self._compile(first_piece), self._compile(middle_piece), self._compile(last_piece))

    def _compile(self, function: Callable) -> Callable:
        return torch.compile(function, backend=self._inductor, dynamic=True, fullgraph=True)

    def _inductor(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        self.compilations += 1
        # compile_fx's annotation covers its other inputs too; a GraphModule compiles to a callable.
        return compile_fx(graph, example_inputs, config_patches=self.options)  # type: ignore[return-value]

    def rows(self, num_tokens: int) -> int:
        """The row count a step of num_tokens tokens runs at."""
        return row_bucket(num_tokens) if self.pads_rows else num_tokens

    def warm_up(self, max_tokens: int) -> None:
        """Compile (and on CUDA capture) every shape a step of up to max_tokens tokens can take."""
        started = time.perf_counter()
        sizes = sorted({self.rows(n) for n in range(1, max_tokens + 1)}) if self.pads_rows else [1, 2]
        with torch.inference_mode():
            for rows in sizes:
                self._run_pieces(rows)
        logger.info("compiled step ready in %.1fs: %d graphs, %d row counts warmed",
                    time.perf_counter() - started, self.compilations, len(sizes))

    def _run_pieces(self, rows: int) -> None:
        """The step's chain of pieces at `rows` rows, on placeholder inputs (the KV cache is
        not touched): one middle piece compiles the graph all layers share."""
        model, layers = self.model, self.model.layers
        input_ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
        # position 0 for every row: a bucket may hold more rows than the model has positions
        # (CUDA checks the rotary table's index; the CPU read past it unchecked)
        positions = torch.zeros(rows, dtype=torch.int64, device=self.device)
        h, q, _, _ = self.pieces.first(model, input_ids, positions)
        attn = torch.zeros_like(q)
        for i in range(min(1, len(layers) - 1)):
            h, *_ = self.pieces.middle(model, layers[i], layers[i + 1], h, attn, positions)
        self.pieces.last(model, layers[-1], h, attn)


def compile_wanted(config: EngineConfig, device: torch.device) -> bool:
    """`compile: auto` compiles on CUDA only: on CPU the eager step with packed half-precision
    weights is faster (inductor takes plain weights), and float32 gained too little for the
    seconds of load it costs (benchmarks/RESULTS.md, "Figures behind design choices in the
    code"). Not with LoRA adapters, whose step runs eager, nor `deterministic`, whose kernels are
    the batch-invariant ones (inductor would fuse the norms and pick its own GEMMs)."""
    auto = config.compile_supported and not config.enable_lora and not config.deterministic and device.type == "cuda"
    return config.compile == "on" or (config.compile == "auto" and auto)
