"""Every decoder layer of a step in one C call (kernels/cpu/decoder_stack.c).

Why: a 30-layer model's step makes ~310 calls into the C kernels, and the Python around
them was a sizeable part of a step at 32 sequences (2-core Zen 4, bf16;
benchmarks/RESULTS.md, "Figures behind design choices in the code"), time in which the
OpenMP worker thread only waits. The C loop calls the same kernels, through their own
libraries' function addresses, in the same order on the same buffers: the hidden states
are the eager layers' to the bit (tests/kernels/test_decoder_stack_cpu.py).

It takes what those kernels take on the usual CPU steps - bf16 (weights in pairs) or float32
(weights as the checkpoint's GGUF blocks), a KV cache of the same dtype, attention by the C
decode and prefill loops; `DecoderStack.run` returns None for anything else and the model runs
its layers in Python.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from . import (
    bf16_matmul,
    block_matmul,
    cache_write,
    paged_decode,
    paged_prefill,
    rms_norm,
    rotary,
    silu_mul,
)
from .bf16_matmul import GROUP, PairWeight
from .block_matmul import BLOCK_KINDS, BlockWeight
from .native_build import C_DTYPES, NativeLibrary
from .paged_attention import DecodePlan
from .paged_prefill import PrefillChunks

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class Kernels(ctypes.Structure):
    """The kernels' function addresses (decoder_stack.c's Kernels)."""

    _fields_ = [(name, _p) for name in
                ("matmul", "norm", "add_norm", "rotary", "write_cache", "decode", "prefill", "silu_mul",
                 "block_matmul")]


class LinearWeights(ctypes.Structure):
    """A linear's pairs and GGUF blocks, either NULL where it has none (decoder_stack.c's Linear)."""

    _fields_ = [("pairs", _p), ("bias", _p), ("groups", _i64), ("codes", _p), ("scales", _p), ("offsets", _p),
                ("kind", _i32), ("batch_invariant", _i32)]


class LayerWeights(ctypes.Structure):
    """One layer's norms, linears and KV cache (decoder_stack.c's Layer)."""

    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", LinearWeights), ("o", LinearWeights),
                ("gate_up", LinearWeights), ("down", LinearWeights), ("key_cache", _p), ("value_cache", _p)]


class StepArgs(ctypes.Structure):
    """One step's shapes, attention plan and buffers (decoder_stack.c's Step)."""

    _fields_ = [(name, _i32) for name in  # type: ignore[assignment]  # mypy joins the field types to object
                ("tokens", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size", "dtype",
                 "num_threads")] + [
        ("num_slots", _i64), ("eps", _f32), ("scale", _f32), ("cos", _p), ("sin", _p), ("slot_mapping", _p),
        ("num_decodes", _i32), ("tables", _p), ("table_width", _i64), ("lens", _p), ("decode_rows", _p),
        ("num_chunks", _i32), ("chunk_slots", _p), ("slot_starts", _p), ("q_starts", _p), ("q_lens", _p),
        ("seq_lens", _p), ("final_norm", _p), ("few_rows", _i32), ("num_outputs", _i32), ("output_rows", _p),
        ("few_output_rows", _i32), ("xf", _p), ("yf", _p),
    ] + [(name, _p) for name in ("h", "x", "qkv", "qk", "attn", "delta", "gate_up", "act", "out")]


def _declare(library: ctypes.CDLL) -> None:
    library.decoder_stack.argtypes = [ctypes.POINTER(Kernels), ctypes.POINTER(LayerWeights), _i32,
                                      ctypes.POINTER(StepArgs)]
    library.decoder_stack.restype = _i32


LIBRARY = NativeLibrary(Path(__file__).with_name("decoder_stack.c"), "CPU decoder stack",
                        "the layers in Python", _declare)


def kernels() -> Kernels | None:
    """The kernels' addresses; None unless every library is built."""
    functions = {
        "matmul": (bf16_matmul.LIBRARY, "bf16_matmul"), "norm": (rms_norm.LIBRARY, "rms_norm"),
        "add_norm": (rms_norm.LIBRARY, "add_rms_norm"), "rotary": (rotary.LIBRARY, "rotary"),
        "write_cache": (cache_write.LIBRARY, "write_kv_cache"), "decode": (paged_decode.LIBRARY, "paged_decode"),
        "prefill": (paged_prefill.LIBRARY, "paged_prefill"), "silu_mul": (silu_mul.LIBRARY, "silu_mul"),
        "block_matmul": (block_matmul.LIBRARY, "block_matmul_f32"),
    }
    addresses = {}
    for field, (library, name) in functions.items():
        loaded = library.get()
        if loaded is None:
            return None
        addresses[field] = ctypes.cast(getattr(loaded, name), _p).value
    return Kernels(**addresses)


@dataclass(frozen=True)
class LinearTensors:
    """A linear as its steps multiply it: bf16, its weight in pairs and the GGUF blocks a few
    rows multiply (None: none); float32, its GGUF blocks only (`pairs` None) and its bias."""

    pairs: PairWeight | None
    blocks: BlockWeight | None = None
    bias: torch.Tensor | None = None
    """float32 only: the layer's float32 bias (the pairs carry their own)."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.pairs is None else torch.bfloat16

    def weights(self, with_bias: bool) -> LinearWeights | None:
        """None where the C loop does not take it: outputs padded to whole groups, or a bias
        where the layer has none in the Python path either (`with_bias` False)."""
        pairs, blocks = self.pairs, self.blocks
        if pairs is None:
            if blocks is None:
                return None
            groups, out_features = blocks.scales.shape[0], blocks.out_features
            bias = self.bias
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (out_features,)):
                return None
        else:
            groups, out_features, bias = pairs.pairs.shape[0], pairs.out_features, pairs.bias
            if blocks is not None and blocks.scales.shape[0] != groups:
                return None
        if out_features != groups * GROUP or (bias is not None and not with_bias):
            return None
        codes = (None, None, None, 0, 0) if blocks is None else (
            blocks.codes.data_ptr(), blocks.scales.data_ptr(), blocks.offsets.data_ptr(), BLOCK_KINDS[blocks.kind],
            int(blocks.batch_invariant))
        return LinearWeights(None if pairs is None else pairs.pairs.data_ptr(), None if bias is None else bias.data_ptr(),
                             groups, *codes)


@dataclass(frozen=True)
class LayerTensors:
    """What one layer hands the C loop: its norms' weights, its linears, its cache."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearTensors
    o: LinearTensors
    gate_up: LinearTensors
    down: LinearTensors
    key_cache: torch.Tensor
    value_cache: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.qkv.dtype

    def weights(self) -> LayerWeights | None:
        """The C layer; None where the C loop does not take these tensors."""
        dtype = self.dtype
        if any(w.dtype != dtype for w in (self.o, self.gate_up, self.down)) or not all(
                t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
                for t in (self.input_norm, self.post_norm, self.key_cache, self.value_cache)):
            return None
        linears = [self.qkv.weights(with_bias=True), *(w.weights(with_bias=False) for w in (self.o, self.gate_up, self.down))]
        if None in linears:
            return None
        return LayerWeights(self.input_norm.data_ptr(), self.post_norm.data_ptr(), *linears,
                            self.key_cache.data_ptr(), self.value_cache.data_ptr())


@dataclass(frozen=True)
class OutputRows:
    """The rows of a step whose hidden states are wanted (those sampled): int64, ascending and
    distinct; `few_rows` says whether Linear.forward multiplies that many rows by the GGUF blocks."""

    rows: torch.Tensor
    few_rows: bool


@dataclass(frozen=True)
class StackShape:
    """The model's sizes and constants the loop needs."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecoderStack:
    """The C layers of one model over one set of KV caches (built once, reused every step)."""

    def __init__(self, layers: list[LayerTensors], final_norm: torch.Tensor, shape: StackShape):
        self.kernels = kernels() if LIBRARY.get() is not None else None
        built = [layer.weights() for layer in layers]
        weights = [w for w in built if w is not None]
        self.dtype = layers[0].dtype if layers else torch.bfloat16
        self.layers = None if self.kernels is None or len(weights) < len(built) or final_norm.dtype != self.dtype else (
            (LayerWeights * len(weights))(*weights))
        self.tensors = (layers, final_norm)  # what the addresses point into, kept alive
        self.final_norm, self.shape = final_norm, shape
        cache = layers[0].key_cache if layers else None
        self.block_size = 0 if cache is None else cache.shape[1]
        self.num_slots = 0 if cache is None else cache.shape[0] * cache.shape[1]

    @property
    def usable(self) -> bool:
        return self.layers is not None

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            decode: DecodePlan | None, prefill: PrefillChunks | None, few_rows: bool = False,
            output_rows: OutputRows | None = None) -> torch.Tensor | None:
        """The final norm's output [tokens, hidden] for the embeddings `h` (overwritten: it
        carries the residual stream), or for the rows `output_rows` names alone; None where the
        C loop declined the step (a kernel's shape limits, a cache slot out of range): the
        caller runs the layers in Python. `few_rows`: the linears with GGUF blocks multiply
        those, as Linear.forward does for this many rows."""
        s = self.shape
        tokens = h.shape[0]
        library = LIBRARY.get()  # loaded wherever self.layers was built
        if (self.layers is None or self.kernels is None or library is None
                or h.dtype != self.dtype or not h.is_contiguous() or tokens == 0
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
            return None
        new = h.new_empty
        qkv_width = self.layers[0].qkv.groups * GROUP
        buffers = dict(x=new((tokens, s.hidden)), qkv=new((tokens, qkv_width)),
                       qk=new((tokens, s.heads + s.kv_heads, s.head_dim)), attn=new((tokens, s.heads, s.head_dim)),
                       delta=new((tokens, s.hidden)), gate_up=new((tokens, 2 * s.intermediate)),
                       act=new((tokens, s.intermediate)), out=new((tokens, s.hidden)))
        args = StepArgs(
            tokens=tokens, hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
            intermediate=s.intermediate, block_size=self.block_size if decode is None else decode.block_size,
            dtype=C_DTYPES[self.dtype],
            num_threads=torch.get_num_threads(), num_slots=self.num_slots, eps=s.eps, scale=s.scale,
            cos=cos.data_ptr(), sin=sin.data_ptr(), slot_mapping=slot_mapping.data_ptr(), final_norm=self.final_norm.data_ptr(),
            h=h.data_ptr(), **{name: tensor.data_ptr() for name, tensor in buffers.items()},
        )
        if output_rows is not None:
            rows = output_rows.rows
            args.num_outputs, args.output_rows, args.few_output_rows = rows.numel(), rows.data_ptr(), output_rows.few_rows
        if (few_rows or (output_rows is not None and output_rows.few_rows)) and self.dtype == torch.bfloat16:
            # The float32 scratch the few-row linears need, for the whole step's rows or for the
            # last layer's kept rows alone: `few_rows` (every layer's rows) stays as given, else
            # a prompt with one sampled row multiplied all its rows by the GGUF blocks in every
            # layer, where the Python layers use the pairs (issue 43).
            widest = max(qkv_width, 2 * s.intermediate, s.hidden, s.heads * s.head_dim)
            scratch = torch.empty((2, tokens, widest), dtype=torch.float32)
            args.few_rows, args.xf, args.yf = int(few_rows), scratch[0].data_ptr(), scratch[1].data_ptr()
        if decode is not None:
            args.num_decodes, args.tables = decode.tokens.numel(), decode.tables.data_ptr()
            args.table_width = decode.tables.shape[1]
            args.lens, args.decode_rows = decode.lens.data_ptr(), decode.tokens.data_ptr()
        if prefill is not None:
            args.num_chunks, args.chunk_slots = prefill.q_lens.numel(), prefill.slots.data_ptr()
            args.slot_starts, args.q_starts = prefill.slot_starts.data_ptr(), prefill.q_starts.data_ptr()
            args.q_lens, args.seq_lens = prefill.q_lens.data_ptr(), prefill.seq_lens.data_ptr()
        status = library.decoder_stack(ctypes.byref(self.kernels), self.layers, len(self.layers), ctypes.byref(args))
        if status != 0:
            return None
        return buffers["out"] if output_rows is None else buffers["out"][: output_rows.rows.numel()]


__all__ = ["DecoderStack", "LayerTensors", "LinearTensors", "OutputRows", "StackShape", "kernels"]
