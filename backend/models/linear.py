"""The model's dense linear layer: nn.Linear whose oneDNN calls on CPU see a few row counts.

On CPU, torch runs bf16/fp16 matmuls through oneDNN, which builds a kernel for every
input shape (a delay a step notices on a 2-core machine) and keeps up to 1,024 of them (a
few hundred KB each). The row count is the step's token count, which changes nearly every
step: without buckets each new count pays the build and the cache grows to hundreds of
MB over a long run. Rows padded to a bucket (exact up to EXACT_ROWS, then a multiple of
16 up to 256, of 64 up to 1,024, then of 256) leave under a hundred shapes per layer.
Exact up to 64 rows because a decode step's rows are its sequences, and where oneDNN's
bf16 kernel is bound by arithmetic (AVX512-BF16 without AMX) every padding row costs as
much as a real one: 17 sequences padded to 32 took far longer than 17. Rows are
independent in a matmul, so the padding rows (zeros) change nothing in the real ones.
float32 laid out for MKL and CUDA need no buckets and take the plain path.

Where the CPU has AVX512-BF16 but no AMX, a bf16 weight goes to neither: it is packed once,
at load, in pairs of inputs for the C kernel of kernels/cpu/bf16_matmul.py (`pairs`),
faster than oneDNN at the 6-128 rows of decode steps (every decoder linear, 2-core Zen 4),
with no kernel per shape and so no buckets. Otherwise the same half-precision weights are
packed once, at load, into oneDNN's blocked layout (`pack_weights`): an unpacked weight is
re-laid-out by oneDNN on every call, which made the matmuls of a decode step markedly
slower (AMX Xeon, 2 cores). float32 weights are stored transposed, [in, out]: MKL
multiplies x @ W^T slower at 4-16 rows than x @ (that copy) on a Xeon with AVX-512. A
float32 weight can also be packed for oneDNN ("onednn"), faster from 8 rows on AMD EPYCs,
where MKL is slow; or kept in "both" layouts: the plain [out, in] weight for up to
GEMV_MAX_ROWS rows, through the C matrix-vector loop of kernels/cpu/gemv.py (a single
stream's decode, bound by streaming the weights, which that loop reads faster than
oneDNN on a 2-core EPYC), and the packed one for more. Which layout each part of the
model gets is measured (`WeightLayouts`, backend/matmul_probe.py); the figures behind
these comparisons are in benchmarks/RESULTS.md ("Zen 4: CPU kernels", "Packed bf16
weights and the compiled step on CPU", "Figures behind design choices in the code").
A float32 weight that is exactly a GGUF Q4_1 or Q8_0 one (the bundled model's layers, its
embedding) keeps none of these: every step multiplies those blocks (`blocks`,
kernels/cpu/block_matmul.py), the same values in a sixth or a third of the bytes, faster
than oneDNN's float32 kernel at every row count measured (1-512 rows, 2-core AVX2 EPYC).
All only reorder the weight or the additions: the product is the same up to the order of
additions. Half-precision weights rounded from such blocks keep the blocks too
(`few_row_blocks`, given at load): up to FEW_ROWS rows multiply them in float32, since a few
rows are bound by streaming the weight and the blocks are a third of bf16's bytes. A
oneDNN-packed weight of any dtype builds a kernel per row count, so its rows
take the buckets above.
The compiled step keeps the plain weights (inductor cannot take a packed one as input),
so an engine packs only when it runs eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu, block_matmul as block_matmul_cpu
from pagedserve.kernels.cpu.bf16_matmul import PairWeight, pack_pairs, pair_matmul
from pagedserve.kernels.cpu.block_matmul import BlockWeight, as_blocks, block_matmul
from pagedserve.kernels.cpu.gemv import GEMV_MAX_ROWS, gemv

logger = logging.getLogger("pagedserve")


EXACT_ROWS = 64
"""Row counts the eager CPU linear runs unpadded (one oneDNN kernel each, built on first use)."""

FEW_ROWS = 8
"""Half precision on CPU: up to this many rows multiply the weight's exact GGUF blocks in
float32 (`few_row_blocks`), more take oneDNN's packed kernel. A few rows are bound by
streaming the weight (a third of bf16's bytes in Q4_1 blocks); many by arithmetic, where
AVX512-BF16 doubles float32's rate (2-core Zen 4, every decoder linear: the blocks ahead at
1 and 8 rows, oneDNN's bf16 ahead at 32; benchmarks/RESULTS.md, "Zen 4: CPU kernels")."""

FEW_ROWS_BESIDE_PAIRS = 4
"""FEW_ROWS where the layer has `pairs` (the C AVX512-BF16 kernel, from 5 rows faster than the
blocks: every decoder linear on a 2-core Zen 4, the blocks ahead at 4 rows, the pairs at 6
and 8; benchmarks/RESULTS.md, "Zen 4: CPU kernels")."""


def row_bucket(rows: int, exact: int = 16) -> int:
    """The padded row count for `rows`: itself up to `exact`, else the next multiple of 16
    (<= 256 rows), 64 (<= 1,024) or 256. The compiled step keeps exact at 16: each of its
    row counts is a compiled graph (a CUDA graph on CUDA) made at load."""
    if rows <= exact:
        return rows
    step = 16 if rows <= 256 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


FLOAT32_LAYOUTS = ("transposed", "onednn", "both")


@dataclass(frozen=True)
class WeightLayouts:
    """The float32 layout (one of FLOAT32_LAYOUTS) of the decoder layers' linears and of the
    LM head; half-precision weights are packed for oneDNN whatever these say."""

    layers: str = "transposed"
    lm_head: str = "transposed"
    batch_invariant: bool = False
    """Exact GGUF blocks summed in one order at every row count (BlockWeight.batch_invariant)."""

    def __post_init__(self) -> None:
        for layout in (self.layers, self.lm_head):
            if layout not in FLOAT32_LAYOUTS:
                raise ValueError(f"float32 layout must be one of {FLOAT32_LAYOUTS}, not {layout!r}")


BATCH_INVARIANT_LAYOUTS = WeightLayouts("onednn", "onednn", batch_invariant=True)
"""float32 layouts whose product of a row does not depend on how many rows are multiplied
with it: oneDNN's packed kernel, and GGUF blocks in one order. MKL (transposed) and the C
GEMV ("both": a few rows) sum a few rows in another order than many
(tests/test_engine_greedy.py pins this)."""


PACK_ROWS_HINT = 64
"""The row count oneDNN picks the packed layout for: measured best over 1-256 rows."""


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    """The weight in oneDNN's blocked layout (CPU: half precision, or float32 laid out "onednn"), after `pack_weights`."""
    transposed: torch.Tensor | None = None
    """The weight as [in, out] (CPU, float32 laid out "transposed"), after `pack_weights`."""
    gemv_rows: int = 0
    """Row counts up to this go through the C matrix-vector loop over the plain weight (CPU
    float32 laid out "both")."""
    blocks: BlockWeight | None = None
    """The weight's GGUF Q4_1 or Q8_0 parts where they rebuild it exactly (CPU float32, after
    `pack_weights`): every step multiplies them, in a sixth or a third of the bytes, and the
    layer keeps no other copy."""

    pairs: PairWeight | None = None
    """A bf16 weight packed for the C AVX512-BF16 kernel (kernels/cpu/bf16_matmul.py, after
    `pack_weights`, where the CPU has the instruction and no AMX): every step of more than
    FEW_ROWS_BESIDE_PAIRS rows multiplies it, and the layer keeps no oneDNN copy."""
    few_row_blocks: BlockWeight | None = None
    """Half precision on CPU: the GGUF blocks the weight was rounded from (set at load), which
    up to FEW_ROWS rows multiply in float32; the rounded weight, packed, takes more rows.
    So a sequence's logits differ in the last bits between steps of few and many rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return self._block_matmul(x, self.blocks)
        rows = x.shape[0]
        if self.few_row_blocks is not None and x.dim() == 2 and rows <= self.few_block_rows:
            bias = None if self.bias is None else self.bias.float()
            out = block_matmul(x.float().contiguous(), self.few_row_blocks, bias)
            if out is not None:
                return out.to(x.dtype)
        if self.pairs is not None:
            return self._pair_matmul(x, self.pairs)
        # Inside the compiled step (plain weights) the rows are padded to a bucket already.
        bucket = row_bucket(rows, EXACT_ROWS) if self.packed is not None and x.dim() == 2 else rows
        if bucket != rows:
            padded = x.new_zeros((bucket, x.shape[1]))
            padded[:rows] = x
            return self._matmul(padded)[:rows]
        return self._matmul(x)

    def _block_matmul(self, x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = block_matmul(flat, blocks, self.bias)
        if out is None:  # not float32 rows (or none): through the weight the blocks rebuild
            bias = None if self.bias is None else self.bias.to(x.dtype)
            out = F.linear(flat, blocks.dequantize().to(x.dtype), bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def few_block_rows(self) -> int:
        """Row counts up to this multiply `few_row_blocks` (where the layer has them)."""
        return FEW_ROWS if self.pairs is None else FEW_ROWS_BESIDE_PAIRS

    def _pair_matmul(self, x: torch.Tensor, pairs: PairWeight) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a step's rows are 2-D already
        out = pair_matmul(flat.contiguous(), pairs)
        if out is None:  # not bf16 rows (or none): through the weight the pairs hold
            out = F.linear(flat, pairs.unpack().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.gemv_rows:
            out = gemv(x, self.weight, self.bias)
            if out is not None:  # else (no C compiler) the packed weight below
                return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.transposed is not None:
            out = torch.matmul(x, self.transposed)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)

    @property
    def reads_plain_weight(self) -> bool:
        """Whether the layer still multiplies by `weight` after packing (so it must stay)."""
        return (self.packed is None and self.transposed is None and self.blocks is None
                and self.pairs is None) or self.gemv_rows > 0

    def pack(self, float32_layout: str = "transposed", batch_invariant: bool = False) -> bool:
        """Lay a CPU weight out as its matmul reads it fastest: half precision packed for
        oneDNN, float32 as `float32_layout` says (exact GGUF blocks summed in one order at
        every row count where `batch_invariant`); False where nothing applies."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if float32_layout not in FLOAT32_LAYOUTS:
            raise ValueError(f"float32_layout must be one of {FLOAT32_LAYOUTS}, not {float32_layout!r}")
        if weight.dtype == torch.float32 and block_matmul_cpu.LIBRARY.get() is not None:
            blocks = as_blocks(weight)  # whatever the layout: exact GGUF blocks serve every step
            if blocks is not None:
                self.blocks = dataclasses.replace(blocks, batch_invariant=batch_invariant)
                return True
        if weight.dtype == torch.bfloat16 and bf16_matmul_cpu.native():
            self.pairs = pack_pairs(weight, self.bias)
            if self.pairs is not None:
                return True
        onednn = torch.backends.mkldnn.is_available()
        if weight.dtype == torch.float32 and (float32_layout == "transposed" or not onednn):
            self.transposed = weight.detach().t().contiguous()
            return True
        if not onednn:
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        except RuntimeError:  # oneDNN packs fp16 only on CPUs with avx512_fp16 or avx_ne_convert
            return False
        if weight.dtype == torch.float32 and float32_layout == "both":
            self.gemv_rows = GEMV_MAX_ROWS  # the plain weight, kept
        return True


def keep_exact_blocks(linear: Linear, weight: torch.Tensor) -> None:
    """Give a half-precision CPU layer the GGUF blocks of its checkpoint weight (`weight`,
    before rounding to the model's dtype) for its few-row matmuls, where they rebuild it."""
    if block_matmul_cpu.LIBRARY.get() is not None:
        linear.few_row_blocks = as_blocks(weight.float())


def pack_weights(model: nn.Module, layouts: WeightLayouts = WeightLayouts()) -> int:
    """Pack every dense CPU Linear of the model (see the module docstring), float32 ones as
    `layouts` says for the model's `lm_head` and for the rest; how many were packed. A
    packed layer's plain weight is released unless another module shares it (a tied
    embedding) or the layer still reads it ("both"): packing costs no memory beyond that."""
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    packed = 0
    for module in model.modules():
        layout = layouts.lm_head if module is getattr(model, "lm_head", None) else layouts.layers
        if isinstance(module, Linear) and module.pack(layout, layouts.batch_invariant):
            packed += 1
            if id(module.weight) not in shared and not module.reads_plain_weight:
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    blocks = sum(isinstance(m, Linear) and m.blocks is not None for m in model.modules())
    if blocks:
        logger.info("%d of %d packed linears are exact GGUF Q4_1/Q8_0 weights: multiplied through those blocks "
                    "(kernels/cpu/block_matmul.py) at every step, in a third to a sixth of the float32 bytes",
                    blocks, packed)
    return packed
