"""How a dense linear multiplies on CPU: one `LinearMethod` per weight form, chosen per layer at load.

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

The forms, in the order `method_for` tries them:
- `Blocks`: a float32 weight that is exactly a GGUF Q4_1 or Q8_0 one (the bundled model's
  layers, its embedding) is multiplied through those blocks at every step
  (kernels/cpu/block_matmul.py), the same values in a sixth or a third of the bytes.
- `Pairs`: where the CPU has AVX512-BF16 (and, with AMX, the kernel its tiles), a bf16 weight
  is packed in pairs of inputs for the C kernel of kernels/cpu/bf16_matmul.py, which beats
  oneDNN at the rows of decode steps, with no kernel per shape and so no buckets. With
  `batch_invariant` on every CPU the kernel builds for: it sums a row in one order at any row
  count, where oneDNN's bf16 kernels do not (with AMX the first row of a 4096 x 4096 layer
  differs between a step of 32 rows, 64 and 1,024; tests/cpu/test_linear_methods.py).
- `Transposed`: float32 stored [in, out], which MKL multiplies faster than x @ W^T at a few
  rows on a Xeon with AVX-512.
- `OneDnnPacked`: otherwise the weight packed once into oneDNN's blocked layout (an unpacked
  one is re-laid-out by oneDNN on every call); for float32 laid out "both" it keeps the
  plain weight too, which up to GEMV_MAX_ROWS rows stream through the C matrix-vector loop
  of kernels/cpu/gemv.py (a single stream's decode, faster than oneDNN on a 2-core EPYC).
- `FewRowBlocks` wraps any of these for a half-precision weight rounded from GGUF blocks
  (kept at load, `keep_exact_blocks`): up to a few rows multiply the blocks in float32,
  since a few rows are bound by streaming the weight and the blocks are a third of bf16's
  bytes. So a sequence's logits differ in the last bits between steps of few and many rows.
Which float32 layout each part of the model takes is measured (`WeightLayouts`,
backend/cpu/matmul_probe.py). All only reorder the weight or the additions: the product is the
same up to the order of additions. The figures behind these choices are in
benchmarks/RESULTS.md ("Zen 4: CPU kernels", "Packed bf16 weights and the compiled step on
CPU", "Figures behind design choices in the code"). The compiled step keeps the plain
weights (inductor cannot take a packed one as input), so an engine packs only when it runs
eagerly.
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

from ..models.linear import Linear, LinearMethod, row_bucket

logger = logging.getLogger("pagedserve")


EXACT_ROWS = 64
"""Row counts a oneDNN-packed weight multiplies unpadded (one oneDNN kernel each, built on first use)."""

FEW_ROWS = 8
"""Half precision: up to this many rows multiply the weight's exact GGUF blocks in
float32 (`FewRowBlocks`), more take the rounded weight. A few rows are bound by
streaming the weight (a third of bf16's bytes in Q4_1 blocks); many by arithmetic, where
AVX512-BF16 doubles float32's rate (2-core Zen 4, every decoder linear: the blocks ahead at
1 and 8 rows, oneDNN's bf16 ahead at 32; benchmarks/RESULTS.md, "Zen 4: CPU kernels")."""

FEW_ROWS_BESIDE_PAIRS = 4
"""FEW_ROWS where the layer has `Pairs` and the C kernel runs VDPBF16PS (from 5 rows faster than
the blocks: every decoder linear on a 2-core Zen 4, the blocks ahead at 4 rows, the pairs at 6
and 8; benchmarks/RESULTS.md, "Zen 4: CPU kernels"). AMX tiles are ahead of the blocks from one
row ("Xeon (AMX): CPU kernels"), so no blocks are kept beside them."""

PACK_ROWS_HINT = 64
"""The row count oneDNN picks the packed layout for: measured best over 1-256 rows."""

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


DEFAULT_LAYOUTS = WeightLayouts()
"""MKL's transposed float32 layout throughout: what an engine without the probe's verdict takes."""

BATCH_INVARIANT_LAYOUTS = WeightLayouts("onednn", "onednn", batch_invariant=True)
"""float32 layouts whose product of a row does not depend on how many rows are multiplied
with it: oneDNN's packed kernel, and GGUF blocks in one order. MKL (transposed) and the C
GEMV ("both": a few rows) sum a few rows in another order than many
(tests/test_engine_greedy.py pins this)."""


def _flat(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 2 else x.reshape(-1, layer.in_features)  # a step's rows are 2-D already


def _shaped(layer: Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], layer.out_features)


def _bias(layer: Linear, dtype: torch.dtype) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias.to(dtype)


@dataclass(frozen=True)
class Blocks:
    """A float32 weight that is exactly GGUF Q4_1 / Q8_0 blocks, multiplied through them; the
    layer keeps no other copy."""

    blocks: BlockWeight
    reads_plain_weight = False

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = _flat(layer, x).contiguous()
        out = block_matmul(flat, self.blocks, layer.bias)
        if out is None:  # not float32 rows (or none): through the weight the blocks rebuild
            out = F.linear(flat, self.blocks.dequantize().to(x.dtype), _bias(layer, x.dtype))
        return _shaped(layer, x, out)


@dataclass(frozen=True)
class Pairs:
    """A bf16 weight packed for the C kernel (AMX tiles or AVX512-BF16); the layer keeps no oneDNN copy."""

    pairs: PairWeight
    reads_plain_weight = False

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = _flat(layer, x)
        out = pair_matmul(flat.contiguous(), self.pairs)
        if out is None:  # not bf16 rows (or none): through the weight the pairs hold
            out = F.linear(flat, self.pairs.unpack().to(x.dtype), _bias(layer, x.dtype))
        return _shaped(layer, x, out)


@dataclass(frozen=True)
class Transposed:
    """A float32 weight stored [in, out], for MKL."""

    weight_t: torch.Tensor
    reads_plain_weight = False

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight_t)
        return out if layer.bias is None else out + layer.bias


@dataclass(frozen=True)
class OneDnnPacked:
    """The weight in oneDNN's blocked layout, its rows padded to a bucket; with `gemv_rows`,
    up to that many rows stream the plain weight through the C matrix-vector loop instead."""

    packed: torch.Tensor
    gemv_rows: int = 0
    min_rows: int = 1
    """Fewer rows are padded to this many: 2 with `batch_invariant`, since oneDNN multiplies a lone
    row by another kernel than two or more, which sums it in another order (float32 and float16,
    from 2,048 inputs on an AMX Xeon; tests/cpu/test_linear_methods.py)."""

    @property
    def reads_plain_weight(self) -> bool:
        return self.gemv_rows > 0

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self._matmul(layer, x)
        rows = x.shape[0]
        bucket = max(row_bucket(rows, EXACT_ROWS), self.min_rows)
        if bucket != rows:
            padded = x.new_zeros((bucket, x.shape[1]))
            padded[:rows] = x
            return self._matmul(layer, padded)[:rows]
        return self._matmul(layer, x)

    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.gemv_rows:
            out = gemv(x, layer.weight, layer.bias)
            if out is not None:  # else (no C compiler) the packed weight below
                return out
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, layer.bias, "none", [], "")


@dataclass(frozen=True)
class FewRowBlocks:
    """A half-precision weight rounded from GGUF blocks: up to `rows` rows multiply the
    blocks in float32, more go to `then` (None: the plain rounded weight)."""

    blocks: BlockWeight
    then: LinearMethod | None = None
    rows: int = FEW_ROWS

    @property
    def reads_plain_weight(self) -> bool:
        return self.then is None or self.then.reads_plain_weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.rows:
            bias = None if layer.bias is None else layer.bias.float()
            out = block_matmul(x.float().contiguous(), self.blocks, bias)
            if out is not None:
                return out.to(x.dtype)
        return F.linear(x, layer.weight, layer.bias) if self.then is None else self.then.apply(layer, x)


def few_rows_of(method: LinearMethod | None) -> int:
    """Row counts up to which a layer multiplies its few-row GGUF blocks (0: it has none)."""
    return method.rows if isinstance(method, FewRowBlocks) else 0


def method_for(layer: Linear, float32_layout: str = "transposed", batch_invariant: bool = False) -> LinearMethod | None:
    """The fastest way to multiply a CPU layer's weight: half precision packed for oneDNN (or
    in pairs), float32 as `float32_layout` says, exact GGUF blocks whatever it says; None where
    nothing applies. `batch_invariant`: blocks summed in one order at every row count, bf16 in
    pairs wherever the C kernel is built, and a lone row padded to two for oneDNN."""
    weight = layer.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if float32_layout not in FLOAT32_LAYOUTS:
        raise ValueError(f"float32_layout must be one of {FLOAT32_LAYOUTS}, not {float32_layout!r}")
    if weight.dtype == torch.float32 and block_matmul_cpu.LIBRARY.get() is not None:
        blocks = as_blocks(weight)
        if blocks is not None:
            return Blocks(dataclasses.replace(blocks, batch_invariant=batch_invariant))
    if weight.dtype == torch.bfloat16 and (bf16_matmul_cpu.native() or (batch_invariant and bf16_matmul_cpu.LIBRARY.get())):
        pairs = pack_pairs(weight, layer.bias)
        if pairs is not None:
            return Pairs(pairs)
    onednn = torch.backends.mkldnn.is_available()
    if weight.dtype == torch.float32 and (float32_layout == "transposed" or not onednn):
        return Transposed(weight.detach().t().contiguous())
    if not onednn:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    except RuntimeError:  # oneDNN packs fp16 only on CPUs with avx512_fp16 or avx_ne_convert
        return None
    return OneDnnPacked(packed, GEMV_MAX_ROWS if weight.dtype == torch.float32 and float32_layout == "both" else 0,
                        2 if batch_invariant else 1)


def pack(layer: Linear, float32_layout: str = "transposed", batch_invariant: bool = False) -> bool:
    """Give the layer its method (`method_for`), under the few-row blocks it kept at load (dropped
    where AMX tiles take the weight); False where no layout applies (the layer keeps what it had)."""
    method = method_for(layer, float32_layout, batch_invariant)
    if method is None:
        return False
    kept = layer.method
    tiles = isinstance(method, Pairs) and bf16_matmul_cpu.multiplies_in_tiles(layer.in_features)
    if isinstance(kept, FewRowBlocks) and not tiles:
        rows = FEW_ROWS_BESIDE_PAIRS if isinstance(method, Pairs) else FEW_ROWS
        method = FewRowBlocks(kept.blocks, method, rows)
    layer.method = method
    return True


def keep_exact_blocks(layer: Linear, weight: torch.Tensor) -> None:
    """Give a half-precision CPU layer the GGUF blocks of its checkpoint weight (`weight`,
    before rounding to the model's dtype) for its few-row matmuls, where they rebuild it."""
    if block_matmul_cpu.LIBRARY.get() is not None:
        blocks = as_blocks(weight.float())
        if blocks is not None:
            layer.method = FewRowBlocks(blocks)


def pack_weights(model: nn.Module, layouts: WeightLayouts = DEFAULT_LAYOUTS) -> int:
    """Give every dense CPU Linear of the model its method (see the module docstring), float32
    ones as `layouts` says for the model's `lm_head` and for the rest; how many were packed. A
    packed layer's plain weight is released unless another module shares it (a tied
    embedding) or the layer still reads it ("both"): packing costs no memory beyond that."""
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    packed = 0
    for module in model.modules():
        layout = layouts.lm_head if module is getattr(model, "lm_head", None) else layouts.layers
        if isinstance(module, Linear) and pack(module, layout, layouts.batch_invariant):
            packed += 1
            if id(module.weight) not in shared and not module.reads_plain_weight:
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    blocks = sum(isinstance(m, Linear) and isinstance(m.method, Blocks) for m in model.modules())
    if blocks:
        logger.info("%d of %d packed linears are exact GGUF Q4_1/Q8_0 weights: multiplied through those blocks "
                    "(kernels/cpu/block_matmul.py) at every step, in a third to a sixth of the float32 bytes",
                    blocks, packed)
    return packed
