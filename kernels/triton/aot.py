"""Ahead-of-time compilation of every Triton kernel configuration, for named GPUs, without a GPU.

Past 300 lines on purpose: one pipeline (a device model and recorders running the real
launchers, the scenarios, the keys that fold launches into configurations, the compile in
this process or a child), each stage's private types (the Launch and KernelConfig records)
feeding the next; split, the module boundaries would pass those private types around.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` runs entirely on
the CPU (Triton's MLIR passes, then the wheel's own ptxas), so CI can check that
each kernel compiles for sm_80 (A100), sm_89 (L40S / L4 / RTX 4090) and sm_90
(H100), and read what the cubin needs: registers, spills, shared memory.

What is compiled: the configurations the launchers themselves choose. The real
host code runs (`paged_attention_triton`, `write_kv_cache_triton`, the GEMMs'
`_candidates` / `_launch`, `per_token_quant_fp8_triton`) on CPU tensors of the
model shapes below, with the kernels replaced by recorders, under a device model
of the target: its SM count (split-KV and split-K heuristics), its compute
capability (fp8 paths) and compiled (not interpreted) tiles. Every recorded launch
is turned into a compile with the JIT's own argument binder, so signatures,
constexprs, alignment attributes, num_warps and num_stages are exactly what a
launch on that GPU would compile. No tile table is copied here: a new block size
in `_tiles` / `_candidates` or a new constexpr shows up by itself.

Scenarios (per model, activation dtype, KV dtype): decode batches of 1..64
sequences (the default max_num_seqs) over 512..8192 keys (both models' context),
prefill chunks of 16..2048 tokens (the default max_num_batched_tokens) with and
without cached context, one mixed batch; GEMMs at M = 1, 2, 4, 16, 64, 256, 2048 (every
candidate regime: the GEMV's row tiles at M <= 4, M <= 16, <= 64, > 64, with and without split-K) for each
quantized linear (`LlamaForCausalLM.packed_modules`: qkv, o, gate_up, down; the LM
head is never quantized, so the vocabulary size is no GEMM shape here). INT4
group sizes: what `int4_group_size` picks for K, and 32 (GGUF Q4_1 checkpoints).
FP8 GEMM: the mode `default_mode` picks on the target ("w8a16" before sm_89), with
per-channel scales and with block-wise checkpoints' 128-column group scales; int8 weights
(W8A16 checkpoints) in "w8a16" with group scales (they bound the channel form).
The fused MoE kernels: Mixtral-8x7B's, Qwen3-30B-A3B's and gpt-oss-20b's (biased, clamped SwiGLU)
experts (`MOE_MODELS`) at 1..2048 tokens, both row tiles, the experts in the model dtype, e4m3
(per channel; block-wise but gpt-oss's), int8 (but gpt-oss's), 4-bit, and gpt-oss's MXFP4.
gpt-oss-20b's attention sinks on its 128-key window (its global layers' variant is the windowed one less a mask). The batched
LoRA kernels on Llama-3-8B's linears at both row tiles and every rank tile. Sliding-window
attention (a constexpr): Mistral-7B (Llama-3-8B's shapes with a window of 4,096) on a split
decode, unsplit decodes and a prompt chunk past the window; Gemma-2-9B (head dim 256,
soft-capped scores) on the same; its global layers' variant (no window) is the windowed one
less a mask, whose registers and shared memory the windowed one bounds.

One compile per configuration: launches that differ only in runtime integers
(Triton also specialises integers on == 1 and % 16 == 0, e.g. M = 1 vs M = 16)
share the compile of the first such launch; those variants differ in address
arithmetic and masks, not in tiles, stages or shared memory.

TRITON_INTERPRET=1 (the CPU test setting) matters twice. The kernel modules read it
when imported (`@triton.jit` then builds interpreter objects), so this module imports
its own private copies of them (package `_pagedserve_aot_kernels`) with the
interpreter switched off; the modules the rest of the process uses are not touched.
And triton.language's own @jit helpers (tl.zeros_like, tl.cdiv, ...) were built for
the interpreter when triton was imported, so `triton.compile` of any kernel calling
them fails in that process (and leaves triton.language patched for the
interpreter). `compile_all` therefore compiles in one child process without
TRITON_INTERPRET when it has to (`can_compile_in_process`), and in-process
otherwise. Results are cached for the life of the process (and in Triton's on-disk
cache, TRITON_CACHE_DIR, across processes).

Resource numbers come from the cubin (`cuobjdump --dump-resource-usage`, shipped in
the triton wheel): registers per thread, and spills = local memory bytes / 4, the
same figures `CompiledKernel.n_regs` / `n_spills` report after loading on a GPU;
shared memory is Triton's own `metadata.shared` (its dynamic allocation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

# ---------------------------------------------------------------------------------------------
# Targets

# Per-SM limits from the CUDA C Programming Guide, "Technical Specifications per Compute
# Capability" (the same for every GPU of one compute capability):
REGS_PER_SM = 64 * 1024  # 32-bit registers per SM (cc 8.0, 8.9, 9.0)
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256 (8 per thread)
SMEM_ALLOC_UNIT = 128  # shared memory allocation granularity, bytes
SMEM_RESERVED_PER_BLOCK = 1024  # shared memory the CUDA runtime reserves per block (cc >= 8.0)


@dataclass(frozen=True)
class Target:
    name: str
    capability: int  # e.g. 80 for compute capability 8.0
    gpus: Tuple[Tuple[str, int], ...]  # (GPU, SM count): the split heuristics' inputs
    smem_per_sm: int  # bytes of shared memory per SM (the largest carve-out)
    smem_per_block: int  # most dynamic shared memory one block may opt into (= Triton's limit)
    max_warps_per_sm: int
    max_blocks_per_sm: int


TARGETS: Dict[str, Target] = {
    # sm_80: 164 KiB per SM, of which one block may use 163 KiB (1 KiB is reserved).
    "sm_80": Target("sm_80", 80, (("A100", 108),), 164 * 1024, 163 * 1024, 64, 32),
    # sm_89: 100 KiB per SM, 99 KiB per block; 48 warps and 24 blocks per SM.
    "sm_89": Target("sm_89", 89, (("L40S", 142), ("L4", 58)), 100 * 1024, 99 * 1024, 48, 24),
    # sm_90: 228 KiB per SM, 227 KiB per block.
    "sm_90": Target("sm_90", 90, (("H100 SXM", 132), ("H100 PCIe", 114)), 228 * 1024, 227 * 1024, 64, 32),
}


def occupancy(target: Target, registers: int, shared: int, num_warps: int) -> Tuple[int, str]:
    """(resident warps per SM, what limits them): an upper bound from registers, shared
    memory, and the warp / block slots; 0 when one block does not fit at all. Ignores
    the register file's split into 4 SM sub-partitions and L1/shared carve-out choices."""
    regs_per_warp = math.ceil(max(registers, 1) * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    smem_per_block = math.ceil(shared / SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT + SMEM_RESERVED_PER_BLOCK
    limits = {
        "registers": (REGS_PER_SM // regs_per_warp) // num_warps,
        "shared memory": target.smem_per_sm // smem_per_block if shared <= target.smem_per_block else 0,
        "warp slots": target.max_warps_per_sm // num_warps,
        "block slots": target.max_blocks_per_sm,
    }
    limiter = min(limits, key=limits.__getitem__)
    return limits[limiter] * num_warps, limiter


# ---------------------------------------------------------------------------------------------
# Model shapes


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # for completeness: the LM head is not quantized, so no kernel here sees it
    window: Optional[int] = None  # sliding-window attention (its attention scenarios: `_attention_scenarios`)
    softcap: Optional[float] = None  # attention scores soft-capped (Gemma 2)
    sinks: bool = False  # attention sinks (gpt-oss)

    def linears(self) -> Dict[str, Tuple[int, int]]:
        """(N, K) of the quantized linears, as `LlamaForCausalLM.packed_modules` stacks them."""
        return {
            "qkv_proj": ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden),
            "o_proj": (self.hidden, self.heads * self.head_dim),
            "gate_up_proj": (2 * self.intermediate, self.hidden),
            "down_proj": (self.hidden, self.intermediate),
        }


MODELS: Tuple[ModelShape, ...] = (
    ModelShape("Llama-3-8B", 4096, 32, 8, 128, 14336, 128256),
    ModelShape("SmolLM2-135M", 576, 9, 3, 64, 1536, 49152),
    ModelShape("Mistral-7B", 4096, 32, 8, 128, 14336, 32000, window=4096),
    ModelShape("Gemma-2-9B", 3584, 16, 8, 256, 14336, 256000, window=4096, softcap=50.0),
    ModelShape("gpt-oss-20b", 2880, 64, 8, 64, 2880, 201088, window=128, sinks=True),
)
@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int
    inter: int  # each expert's
    experts: int
    top_k: int
    gpt_oss: bool = False  # biased experts and the clamped SwiGLU


MOE_MODELS: Tuple[MoeShape, ...] = (
    MoeShape("Mixtral-8x7B", 4096, 14336, 8, 2),
    MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, gpt_oss=True),
)
MOE_TOKENS = (1, 16, 256, 2048)  # decode batches to a prompt chunk: both row tiles
LORA_TOKENS = (1, 2048)  # both row tiles of the LoRA kernels
LORA_SLOTS = 4  # EngineConfig.max_loras default
LORA_PROJECTIONS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}  # checkpoint projections stacked in each
LORA_MODELS = ("Llama-3-8B",)  # the tiles depend on the rank and the token count, not the widths
DTYPES: Tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)  # engine dtypes
KV_BLOCK_SIZE = 16  # EngineConfig.block_size default (a constexpr of index arithmetic only, not of tiles)
DECODE_BATCHES = (1, 4, 16, 64)
CONTEXTS = (512, 2048, 8192)
PREFILLS = ((16, 0), (64, 8192), (512, 0), (2048, 0))  # (new tokens, cached tokens before them)
GEMM_MS = (1, 2, 4, 16, 64, 256, 2048)  # 1, 2, 4: the GEMV row tiles (triton/gemv.py)
GGUF_GROUP_SIZE = 32  # Q4_1 blocks, kept as the INT4 group when re-quantizing a GGUF checkpoint
FP8_BLOCK = 128  # block-wise FP8 checkpoints' weight_block_size (DeepSeek-V3, Qwen3): group scales of 128 columns

# ---------------------------------------------------------------------------------------------
# Private compiled copies of the kernel modules, and launch recording

_PKG = "_pagedserve_aot_kernels"
_KERNELS = {  # module -> its @triton.jit kernels the launchers call
    "paged_attention": ("_paged_attention_kernel", "_split_reduce_kernel"),
    "cache_write": ("_write_kv_kernel",),
    "gemm": ("_splitk_reduce_kernel",),
    "gemv": ("_w4a16_gemv_kernel", "_w8a16_gemv_kernel"),
    "int4": ("_w4a16_kernel", "_dequant_kernel"),
    "fp8": ("_fp8_gemm_kernel", "_per_token_quant_kernel"),
    "moe": ("_moe_gate_up_kernel", "_moe_down_kernel"),
    "lora": ("_lora_shrink_kernel", "_lora_expand_kernel"),
    "batch_invariant": ("_matmul_kernel", "_rms_norm_kernel", "_log_softmax_kernel"),
}
_LOCK = threading.RLock()


@dataclass(eq=False)
class Launch:
    jit: Any  # the JITFunction
    grid: Tuple[int, ...]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]

    @property
    def kernel(self) -> str:
        return self.jit.fn.__name__

    def bound(self) -> Dict[str, Any]:
        """Every kernel parameter by name (defaults applied), plus the launch options."""
        params = [p.name for p in self.jit.params]
        out = dict(zip(params, self.args))
        out.update(self.kwargs)
        return out


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, jit, log: List[Launch]):
        self.jit, self.log = jit, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(Launch(self.jit, tuple(grid), tuple(map(_light, args)),
                                   {name: _light(value) for name, value in kwargs.items()}))

        return launch


def _light(value: Any) -> Any:
    """A tensor argument as a one-element tensor of its dtype where that changes nothing a compile
    reads (the dtype, and the pointer's 16-byte alignment, which the allocator's fresh tensors keep):
    the recorded launches then hold no model-sized buffer."""
    if isinstance(value, torch.Tensor) and value.numel() > 1 and value.data_ptr() % 16 == 0:
        return torch.empty(1, dtype=value.dtype)
    return value


_MODULES: Optional[SimpleNamespace] = None


def _kernel_modules() -> SimpleNamespace:
    """The kernel modules imported afresh as package `_pagedserve_aot_kernels`, with the
    interpreter off so that their kernels are JITFunctions (see module docstring)."""
    global _MODULES
    with _LOCK:
        if _MODULES is None:
            from triton import knobs

            parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kernels/, the Triton modules' parent
            with knobs.runtime.scope():
                knobs.runtime.interpret = False
                spec = importlib.util.spec_from_file_location(
                    _PKG, os.path.join(parent, "__init__.py"), submodule_search_locations=[parent])
                assert spec is not None and spec.loader is not None  # a .py file's spec
                pkg = importlib.util.module_from_spec(spec)
                sys.modules[_PKG] = pkg
                spec.loader.exec_module(pkg)
                mods = {name: importlib.import_module(f"{_PKG}.triton.{name}") for name in _KERNELS}
            from triton.runtime.jit import JITFunction

            for name, kernels in _KERNELS.items():
                for k in kernels:
                    assert isinstance(getattr(mods[name], k), JITFunction), f"{name}.{k} is not compiled"
            _MODULES = SimpleNamespace(**mods)
    return _MODULES


@contextlib.contextmanager
def _device_model(target: Target, sms: int, log: List[Launch]):
    """Patch the private kernel modules so their launchers act as on `target` with `sms`
    SMs (compiled tiles, fp8 capability, SM count) and record kernel launches in `log`."""
    from .e4m3 import NATIVE_FP8_CAPABILITY

    m = _kernel_modules()
    has_fp8 = divmod(target.capability, 10) >= NATIVE_FP8_CAPABILITY
    native = lambda device: has_fp8  # noqa: E731 - triton/e4m3.py's native_fp8 on the target
    patches: List[Tuple[Any, str, Any]] = [
        (m.paged_attention, "_interpreting", lambda: False),
        (m.paged_attention, "_num_sms", lambda device: sms),
        (m.paged_attention, "native_fp8", native),
        (m.gemm, "num_sms", lambda device: sms),
        (m.int4, "interpreting", lambda: False),
        (m.fp8, "interpreting", lambda: False),
        (m.fp8, "native_fp8", native),
        (m.moe, "interpreting", lambda: False),
        (m.moe, "native_fp8", native),
        (m.lora, "interpreting", lambda: False),
        (m.batch_invariant, "interpreting", lambda: False),
        (m.batch_invariant, "_num_sms", lambda device: sms),
    ]
    for mod, kernels in _KERNELS.items():
        for k in kernels:
            mod_obj = getattr(m, mod)
            patches.append((mod_obj, k, _Recorder(getattr(mod_obj, k), log)))
    with _LOCK:
        saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
        try:
            for mod, name, value in patches:
                setattr(mod, name, value)
            yield m
        finally:
            for mod, name, value in saved:
                setattr(mod, name, value)


# ---------------------------------------------------------------------------------------------
# Scenarios: the real launchers on CPU tensors


def _attention_batch(model: ModelShape, dtype: torch.dtype, q_lens: Sequence[int], seq_lens: Sequence[int]):
    num_tokens = sum(q_lens)
    query = torch.empty(num_tokens, model.heads, model.head_dim, dtype=dtype)
    width = max(-(-s // KV_BLOCK_SIZE) for s in seq_lens)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return query, block_tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def _attention_scenarios(window: Optional[int]) -> List[Tuple[str, List[int], List[int]]]:
    """(label, q_lens, seq_lens) of the batches the attention kernels are launched on: for a model
    with a sliding window, three past it (a split decode, unsplit decodes, a prompt chunk: each row
    tile) whose other variants are the windowless models' (the window is a runtime argument)."""
    if window is not None:
        ctx = 2 * window
        return [(f"decode B={b} ctx={ctx} window={window}", [1] * b, [ctx] * b) for b in (1, 64)] + [
            (f"prefill T=512 ctx={ctx} window={window}", [512], [ctx + 512])]
    out = []
    for b in DECODE_BATCHES:
        for ctx in CONTEXTS:
            out.append((f"decode B={b} ctx={ctx}", [1] * b, [ctx] * b))
    for t, ctx in PREFILLS:
        out.append((f"prefill T={t} ctx={ctx}", [t], [ctx + t]))
    out.append(("mixed 1x1024 prefill + 32 decodes ctx=2048", [1024] + [1] * 32, [1024] + [2048] * 32))
    return out


def _record_attention(m, log: List[Launch], model: ModelShape, dtype: torch.dtype,
                      kv_fp8: bool) -> List[Tuple[str, Launch]]:
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    cache = torch.empty(4, KV_BLOCK_SIZE, model.kv_heads, model.head_dim, dtype=cache_dtype)
    scales = {"k_scale": 0.5, "v_scale": 0.5} if kv_fp8 else {}
    kv = f"{'fp8' if kv_fp8 else str(dtype).replace('torch.', '')} KV"
    out = []
    log.clear()
    new = torch.empty(2, model.kv_heads, model.head_dim, dtype=dtype)
    m.cache_write.write_kv_cache_triton(new, new, cache, cache, torch.zeros(2, dtype=torch.long), **scales)
    out += [(f"{model.name} cache write, {kv}", launch) for launch in log]
    for label, q_lens, seq_lens in _attention_scenarios(model.window):
        log.clear()
        query, tables, lens, starts = _attention_batch(model, dtype, q_lens, seq_lens)
        sinks = torch.empty(model.heads) if model.sinks else None
        m.paged_attention.paged_attention_triton(query, cache, cache, tables, lens, starts, model.head_dim ** -0.5,
                                                 window=model.window, softcap=model.softcap, sinks=sinks, **scales)
        out += [(f"{model.name} {label}, {kv}", launch) for launch in log]
    return out


def _record_moe(m, log: List[Launch], moe: MoeShape, dtype: torch.dtype) -> List[Tuple[str, Launch]]:
    """The fused MoE kernels' launches at each token count, experts in the model dtype, in e4m3
    (per-channel scales, and block-wise checkpoints' 128-column groups), in int8 (per channel) but
    for gpt-oss's (it ships neither), in 4-bit (`int4_group_size`'s group), and gpt-oss's in MXFP4
    (weights allocated, never touched)."""
    from ..int4 import int4_group_size
    from ..moe import ExpertWeights  # read by attribute: the private kernel copy takes it as its own
    from ..mxfp4 import BLOCK as MXFP4_BLOCK

    e, h, i = moe.experts, moe.hidden, moe.inter
    fp8 = torch.float8_e4m3fn
    group = int4_group_size(math.gcd(h, i))
    experts = {
        "": ExpertWeights(torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype)),
        " fp8 experts": ExpertWeights(torch.empty(e, 2 * i, h, dtype=fp8), torch.empty(e, h, i, dtype=fp8),
                                      torch.empty(e, 2 * i), torch.empty(e, h)),
        " int4 experts": ExpertWeights(
            torch.empty(e, h // 8, 2 * i, dtype=torch.int32), torch.empty(e, i // 8, h, dtype=torch.int32),
            torch.empty(e, h // group, 2 * i, dtype=dtype), torch.empty(e, i // group, h, dtype=dtype),
            w13_offset=torch.empty(e, h // group, 2 * i, dtype=dtype), w2_offset=torch.empty(e, i // group, h, dtype=dtype),
            group_size=group),
    }
    if moe.gpt_oss:  # its release's MXFP4 experts, as they are held
        u8 = torch.uint8
        experts[" mxfp4 experts"] = ExpertWeights(
            torch.empty(e, 2 * i, h // 2, dtype=u8), torch.empty(e, h, i // 2, dtype=u8),
            torch.empty(e, 2 * i, h // MXFP4_BLOCK, dtype=u8), torch.empty(e, h, i // MXFP4_BLOCK, dtype=u8),
            group_size=MXFP4_BLOCK)
        experts = {kind: dataclasses.replace(w, w13_bias=torch.empty(e, 2 * i, dtype=dtype),
                                             w2_bias=torch.empty(e, h, dtype=dtype), clamped_swiglu=(1.702, 7.0))
                   for kind, w in experts.items()}
    else:
        experts[" block fp8 experts"] = ExpertWeights(
            torch.empty(e, 2 * i, h, dtype=fp8), torch.empty(e, h, i, dtype=fp8),
            torch.empty(e, 2 * i, math.ceil(h / FP8_BLOCK)), torch.empty(e, h, math.ceil(i / FP8_BLOCK)), group_size=FP8_BLOCK)
        int8 = torch.int8
        experts[" int8 experts"] = ExpertWeights(torch.empty(e, 2 * i, h, dtype=int8), torch.empty(e, h, i, dtype=int8),
                                                 torch.empty(e, 2 * i), torch.empty(e, h))
    out = []
    for kind, weights in experts.items():
        for tokens in MOE_TOKENS:
            ids = torch.arange(tokens * moe.top_k).remainder(moe.experts).view(tokens, moe.top_k)
            for i, config in enumerate(m.moe._candidates(tokens * moe.top_k, moe.experts, weights.group_size)):
                log.clear()
                m.moe._launch(torch.empty(tokens, moe.hidden, dtype=dtype), weights,
                              torch.empty(tokens, moe.top_k, dtype=torch.float32), ids, config)
                out += [(f"{moe.name} MoE T={tokens}{kind}" + _TIMED * (i > 0), launch) for launch in log]
    return out


def _record_lora(m, log: List[Launch], model: ModelShape, dtype: torch.dtype) -> List[Tuple[str, Launch]]:
    """The batched LoRA kernels' launches on each adapted linear at both row tiles, at the default
    max_lora_rank (16) and the largest rank tile (64 a projection): every rank tile, 16 to 64."""
    out = []
    for name, (width_out, width_in) in model.linears().items():
        projections = LORA_PROJECTIONS[name]
        for rank in (16 * projections, 64 * projections):
            for tokens in LORA_TOKENS:
                log.clear()
                m.lora.add_lora_triton(torch.empty(tokens, width_out, dtype=dtype), torch.empty(tokens, width_in, dtype=dtype),
                                       torch.empty(LORA_SLOTS, rank, width_in, dtype=dtype),
                                       torch.empty(LORA_SLOTS, width_out, rank, dtype=dtype), torch.empty(LORA_SLOTS),
                                       torch.arange(tokens, dtype=torch.int32).remainder(LORA_SLOTS + 1) - 1)
                out += [(f"{model.name} LoRA {name} rank {rank} T={tokens}", launch) for launch in log]
    return out


def _record_invariant(m, log: List[Launch], model: ModelShape, dtype: torch.dtype) -> List[Tuple[str, Launch]]:
    """`deterministic`'s launches (kernels/triton/batch_invariant.py, the attention's batch-invariant
    launch): the GEMM on each linear and the LM head (its tiles depend on N, never on M), the norm in
    its three rounding orders over the hidden width and a head (Qwen3's query / key norms), the
    logprobs' log-softmax over the vocabulary, and the attention on a decode batch and a prompt chunk."""
    bi = m.batch_invariant
    out = []
    linears = {**model.linears(), "lm_head": (model.vocab, model.hidden)}
    for name, (n, k) in linears.items():
        log.clear()
        bi.matmul(torch.empty(1, k, dtype=dtype), torch.empty(n, k, dtype=dtype))
        if name == "qkv_proj":  # biased (Qwen2, gpt-oss)
            bi.matmul(torch.empty(1, k, dtype=dtype), torch.empty(n, k, dtype=dtype), torch.empty(n, dtype=dtype))
        out += [(f"{model.name} {name} deterministic", launch) for launch in log]
    for width in (model.hidden, model.head_dim):
        for rounds_once, offset in ((False, 0.0), (True, 0.0), (False, 1.0)):
            log.clear()
            bi.rms_norm(torch.empty(4, width, dtype=dtype), torch.empty(width, dtype=dtype), 1e-6, rounds_once, offset)
            out += [(f"{model.name} norm of {width} deterministic", launch) for launch in log]
    log.clear()
    bi.log_softmax(torch.empty(4, model.vocab))
    out += [(f"{model.name} logprobs deterministic", launch) for launch in log]
    cache = torch.empty(4, KV_BLOCK_SIZE, model.kv_heads, model.head_dim, dtype=dtype)
    sinks = torch.empty(model.heads) if model.sinks else None
    for label, q_lens, seq_lens in (("decode B=64 ctx=8192", [1] * 64, [8192] * 64), ("prefill T=2048", [2048], [2048])):
        log.clear()
        query, tables, lens, starts = _attention_batch(model, dtype, q_lens, seq_lens)
        m.paged_attention.paged_attention_triton(query, cache, cache, tables, lens, starts, model.head_dim ** -0.5,
                                                 window=model.window, softcap=model.softcap, sinks=sinks,
                                                 batch_invariant=True)
        out += [(f"{model.name} {label} deterministic", launch) for launch in log]
    return out


_TIMED = " (timed candidate)"  # a GEMM's or the MoE kernels' candidate after the first: launched only by timed_choice


def _record_gemms(m, log: List[Launch], model: ModelShape, dtype: torch.dtype) -> List[Tuple[str, Launch]]:
    from pagedserve.kernels.int4 import int4_group_size  # the engine's group-size policy

    it, ft = m.int4, m.fp8
    mode = ft.default_mode(torch.device("cuda"))  # patched: the target's capability decides
    out = []
    log.clear()
    for layer, (n, k) in model.linears().items():
        groups = sorted({int4_group_size(k), GGUF_GROUP_SIZE}, reverse=True)
        w8 = m.fp8.Fp8Weight(torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n))
        w8_blocks = m.fp8.Fp8Weight(w8.weight, torch.empty(n, math.ceil(k / FP8_BLOCK)), FP8_BLOCK)
        int8 = m.fp8.Int8Weight(torch.empty(n, k, dtype=torch.int8), w8_blocks.scale, FP8_BLOCK)
        for mm in GEMM_MS:
            x = torch.empty(mm, k, dtype=dtype)
            out_t = torch.empty(mm, n, dtype=dtype)
            label = f"{model.name} {layer} M={mm}"
            for g in groups:
                w4 = it.Int4Weight(torch.empty(k // 8, n, dtype=torch.int32), torch.empty(k // g, n, dtype=dtype),
                                   torch.empty(k // g, n, dtype=dtype), g, (n, k))
                for i, cfg in enumerate(it._candidates(mm, n, k, g)):
                    log.clear()
                    if cfg.variant == "dequant":  # its kernel alone: the matmul after it is cuBLAS's
                        it.dequantize_int4_triton(w4, dtype)
                    else:
                        it._launch(x, w4, None, out_t, cfg)
                    out += [(f"{label} group={g}" + _TIMED * (i > 0), launch) for launch in log]
            for weight, kind, wmode in ((w8, "fp8", mode), (w8_blocks, f"fp8 {FP8_BLOCK}x{FP8_BLOCK} blocks", mode),
                                        (int8, f"int8 group={FP8_BLOCK}", "w8a16")):
                for i, cfg in enumerate(ft._candidates(mm, n, k, wmode, weight.group_size)):
                    log.clear()
                    ft._run(x, weight, None, out_t, cfg, wmode)  # the per-token quantization too, where cfg takes it
                    out += [(f"{label} {kind} {wmode}{' ' + cfg.variant if cfg.variant else ''}" + _TIMED * (i > 0),
                             launch) for launch in log]
    return out


_COMMITTED = "committed "  # the label of a launch replayed from a committed choice (`_record_committed`)


def _replay(m, key: Dict[str, Any], cfg) -> None:
    """Launch what a committed choice (kernels/triton/tuned.py) makes its launcher launch, on empty
    tensors of the key's shape. The whole-matmul choices (cuBLAS after a dequantization, torch._scaled_mm)
    replay the kernels before them only."""
    dtype = getattr(torch, key["dtype"])
    kind = key["kernel"]
    if kind == "lora":
        tokens, slots, rank, k, n = key["m"], key["slots"], key["rank"], key["width_in"], key["width_out"]
        m.lora.add_lora_triton(torch.empty(tokens, n, dtype=dtype), torch.empty(tokens, k, dtype=dtype),
                               torch.empty(slots, rank, k, dtype=dtype), torch.empty(slots, n, rank, dtype=dtype),
                               torch.empty(slots), torch.zeros(tokens, dtype=torch.int32), config=cfg)
        return
    if kind == "moe":
        if key["form"] != "dense":
            raise ValueError(f"committed MoE choices are replayed for experts in the model dtype, not {key['form']}")
        experts, hidden, inter = key["experts"], key["hidden"], key["inter"]
        weights = m.moe.ExpertWeights(torch.empty(experts, 2 * inter, hidden, dtype=dtype),
                                      torch.empty(experts, hidden, inter, dtype=dtype))
        pairs = key["pairs"]
        m.moe._launch(torch.empty(pairs, hidden, dtype=dtype), weights, torch.empty(pairs, 1),
                      torch.zeros(pairs, 1, dtype=torch.int64), cfg)
        return
    mm, n, k, group = key["m"], key["n"], key["k"], key["group"]
    x, out = torch.empty(mm, k, dtype=dtype), torch.empty(mm, n, dtype=dtype)
    if kind == "w4a16":
        w4 = m.int4.Int4Weight(torch.empty(k // 8, n, dtype=torch.int32), torch.empty(k // group, n, dtype=dtype),
                               torch.empty(k // group, n, dtype=dtype), group, (n, k))
        if cfg.variant == "dequant":
            m.int4.dequantize_int4_triton(w4, dtype)
        else:
            m.int4._launch(x, w4, None, out, cfg)
        return
    scale = torch.empty(n, math.ceil(k / group)) if group else torch.empty(n)
    if key["codes"] == "int8":
        weight = m.fp8.Int8Weight(torch.empty(n, k, dtype=torch.int8), scale, group)
    else:
        weight = m.fp8.Fp8Weight(torch.empty(n, k, dtype=torch.float8_e4m3fn), scale, group)
    if cfg.block_m == 0:  # torch._scaled_mm: the per-token quantization before it
        m.fp8.per_token_quant_fp8_triton(x)
    else:
        m.fp8._run(x, weight, None, out, cfg, key["mode"])


def _record_committed(m, log: List[Launch], target: Target) -> List[Tuple[str, Launch]]:
    """The launches of every choice committed for a GPU of `target`'s compute capability
    (kernels/triton/tuned.py's folder: the file's `capability`), so that each is compiled and
    checked like the launchers' own (a committed configuration must not spill)."""
    from .tuned import config_dir, config_from, key_text

    out = []
    for path in sorted(config_dir().glob("*.json")):
        with open(path) as f:
            data = json.load(f)
        if data.get("capability") != target.name:
            continue
        for item in data["choices"]:
            log.clear()
            _replay(m, item["key"], config_from(item["config"]))
            out += [(f"{_COMMITTED}{path.name} {key_text(item['key'])}", launch) for launch in log]
    return out


def decode_programs(target: Target, model_name: str = "Llama-3-8B") -> List[Dict[str, Any]]:
    """What one decode token's quantized linears launch on `target` (its first GPU's SM count): per
    linear of `model_name` at M = 1, the int4 (the engine's group for K) and the fp8 weight GEMMs'
    (in the target's mode) untimed choice: the committed one where `configs/` has a file for this
    capability, else the launcher's first candidate. Each kernel and its programs, to set beside the
    SMs (a weight-bound launch with fewer programs than SMs leaves bandwidth unused)."""
    from pagedserve.kernels.int4 import int4_group_size

    from .tuned import config_dir, config_from, key_text

    committed: Dict[str, Any] = {}
    for path in sorted(config_dir().glob("*.json")):
        with open(path) as f:
            data = json.load(f)
        if data.get("capability") == target.name:
            committed.update({key_text(item["key"]): config_from(item["config"]) for item in data["choices"]})
    gpu, sms = target.gpus[0]
    model = next(m for m in MODELS if m.name == model_name)
    rows: List[Dict[str, Any]] = []
    log: List[Launch] = []
    with _device_model(target, sms, log) as m:
        mode = m.fp8.default_mode(torch.device("cuda"))
        for layer, (n, k) in model.linears().items():
            group = int4_group_size(k)
            keys = {f"int4 g{group}": {"kernel": "w4a16", "m": 1, "n": n, "k": k, "group": group, "dtype": "bfloat16",
                                       "bias": False},
                    "fp8": {"kernel": "fp8", "m": 1, "n": n, "k": k, "dtype": "bfloat16", "mode": mode,
                                    "bias": False, "group": 0, "codes": "float8_e4m3fn"}}
            for kind, key in keys.items():
                cfg = committed.get(key_text(key))
                if cfg is None:
                    cfg = (m.int4._candidates(1, n, k, group) if key["kernel"] == "w4a16"
                           else m.fp8._candidates(1, n, k, mode))[0]
                log.clear()
                _replay(m, key, cfg)
                launches = [(launch.kernel, math.prod(launch.grid)) for launch in log]
                if cfg.block_m == 0:  # a vendor matmul after our kernels (its programs are cuBLAS's to choose)
                    launches.append(("cuBLAS" if cfg.variant == "dequant" else "torch._scaled_mm", 0))
                rows.append(dict(target=target.name, gpu=gpu, sms=sms, layer=layer, n=n, k=k, kind=kind,
                                 mode=key.get("mode", ""), committed=key_text(key) in committed, launches=launches))
    return rows


def programs_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """`decode_programs`' rows of several targets as a markdown table: one line a linear and weight
    kind, one column a target, each cell its launches' programs (a reduction's after a `+`)."""
    targets = list(dict.fromkeys((r["target"], r["gpu"], r["sms"]) for r in rows))
    lines = ["| M = 1 (one decode token) | " + " | ".join(f"{t} {gpu} ({sms} SMs)" for t, gpu, sms in targets) + " |",
             "|---|" + "---:|" * len(targets)]
    for layer, n, k, kind in dict.fromkeys((r["layer"], r["n"], r["k"], r["kind"]) for r in rows):
        cells = []
        for t, _, _ in targets:
            row = next(r for r in rows if (r["target"], r["layer"], r["kind"]) == (t, layer, kind))
            parts = [f"{name.strip('_').removesuffix('_kernel')} {count}" if count else name
                     for name, count in row["launches"]]
            notes = [note for note in (row["mode"], "committed" if row["committed"] else "") if note]
            cells.append(" + ".join(parts) + (f" ({', '.join(notes)})" if notes else ""))
        lines.append(f"| {layer} {n}x{k} {kind} | " + " | ".join(cells) + " |")
    return lines


def resource_lines(results: Sequence[Tuple[KernelConfig, "CompileResult"]]) -> List[str]:
    """Per target: compiles, failures, spills, the most registers and shared memory and whose."""
    lines = []
    for target in dict.fromkeys(r.target for _, r in results):
        mine = [(cfg, r) for cfg, r in results if r.target == target]
        ok = [(cfg, r) for cfg, r in mine if r.ok]
        regs = max(ok, key=lambda p: p[1].registers, default=None)
        smem = max(ok, key=lambda p: p[1].shared, default=None)
        committed = sum(any(u.startswith(_COMMITTED) for u in cfg.uses) for cfg, _ in mine)
        text = (f"{target}: {len(mine)} configurations ({committed} committed choices), {len(mine) - len(ok)} failed, "
                f"{sum(r.spills > 0 for _, r in ok)} spill")
        if regs is not None and smem is not None:
            text += (f"; most registers {regs[1].registers} ({regs[1].kernel} [{regs[1].config}]), most shared memory "
                     f"{smem[1].shared / 1024:.1f} KiB ({smem[1].kernel} [{smem[1].config}])")
        lines.append(text)
    return lines


# ---------------------------------------------------------------------------------------------
# Configurations


@dataclass(eq=False)
class KernelConfig:
    """One compile: a kernel, its constexprs / dtypes / launch options, the first launch
    that chose it (compiled) and every scenario that chose it."""

    kernel: str
    key: Tuple
    launch: Launch
    uses: List[str] = field(default_factory=list)

    @property
    def timed_only(self) -> bool:
        """Launched only while `triton/gemm.py`'s `timed_choice` times candidates (never as the
        first candidate, which runs untimed: PAGEDSERVE_AUTOTUNE=0, CUDA graph capture). A
        candidate that fails to launch there (e.g. too much shared memory) is skipped."""
        return all(u.endswith(_TIMED) for u in self.uses)

    @property
    def summary(self) -> str:
        """Tensor dtypes, constexprs and launch options, compactly (for tables)."""
        b = self.launch.bound()
        parts = []
        for p in self.launch.jit.params:
            v = b[p.name]
            if p.is_constexpr and p.name not in _SUMMARY_SKIP:
                parts.append(f"{p.name}={int(v) if isinstance(v, bool) else v}")
            elif p.name in _SUMMARY_TENSORS and isinstance(v, torch.Tensor):
                parts.append(f"{p.name[:-4]}:{_SHORT_DTYPE.get(v.dtype, v.dtype)}")
        parts.append(f"w{b.get('num_warps', 4)}s{b.get('num_stages', 3)}")
        return " ".join(parts)


_SUMMARY_SKIP = {"DOT_FP32", "DOT_F32", "PRECISION", "FP8_MAX_C", "EPS", "GROUP_M", "HEAD_DIM_PAD", "BLOCK_Q",
                 "KV_BLOCK_SIZE", "BLOCK_SIZE"}
_SUMMARY_TENSORS = {"q_ptr", "k_ptr", "key_ptr", "key_cache_ptr", "x_ptr", "a_ptr", "b_ptr", "part_ptr", "out_ptr"}
_SHORT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                torch.float8_e4m3fn: "e4m3", torch.int32: "i32", torch.int8: "i8"}


def _config_key(launch: Launch) -> Tuple:
    """What makes one compile: the kernel, its constexprs, the dtypes of its tensor
    arguments and the launch options (num_warps, num_stages), not runtime integers."""
    b = launch.bound()
    names = {p.name for p in launch.jit.params}
    parts = []
    for p in launch.jit.params:
        v = b[p.name]
        if p.is_constexpr:
            parts.append((p.name, v))
        elif isinstance(v, torch.Tensor):
            parts.append((p.name, str(v.dtype)))
    options = tuple(sorted((k, v) for k, v in launch.kwargs.items() if k not in names))
    return (launch.kernel, tuple(parts), options)


def enumerate_configs(target: Target, dtypes: Iterable[torch.dtype] = DTYPES,
                      models: Iterable[ModelShape] = MODELS) -> List[KernelConfig]:
    """Every kernel configuration the launchers choose on `target` for these models and
    activation dtypes (float32 only reaches the attention kernels: the quantized GEMMs
    take bf16 / fp16), in first-seen order."""
    configs: Dict[Tuple, KernelConfig] = {}
    for _, sms in target.gpus:
        log: List[Launch] = []
        with _device_model(target, sms, log) as m:
            recorded: List[Tuple[str, Launch]] = []
            for model in models:
                for dtype in dtypes:
                    for kv_fp8 in (False, True):
                        recorded += _record_attention(m, log, model, dtype, kv_fp8)
                    if dtype != torch.float32:
                        recorded += _record_gemms(m, log, model, dtype)
                    recorded += _record_invariant(m, log, model, dtype)
            for moe in MOE_MODELS:
                for dtype in dtypes:
                    if dtype != torch.float32:
                        recorded += _record_moe(m, log, moe, dtype)
            for model in models:
                for dtype in dtypes:
                    if dtype != torch.float32 and model.name in LORA_MODELS:
                        recorded += _record_lora(m, log, model, dtype)
            recorded += _record_committed(m, log, target)
        for label, launch in recorded:
            key = _config_key(launch)
            cfg = configs.setdefault(key, KernelConfig(launch.kernel, key, launch))
            if label not in cfg.uses:
                cfg.uses.append(label)
    return list(configs.values())


_DOMINATED = {  # kernel -> the constexpr whose largest value stands for the others (`representative`)
    "_w4a16_kernel": "BLOCK_K",
    "_fp8_gemm_kernel": "BLOCK_K",
    "_paged_attention_kernel": "NUM_SPLITS",
    "_split_reduce_kernel": "NUM_SPLITS",
    "_splitk_reduce_kernel": "SPLIT_K",
    "_rms_norm_kernel": "BLOCK",
}


_SUPERSEDED = {"_fp8_gemm_kernel": ("GROUP_K",), "_moe_gate_up_kernel": ("HAS_BIAS", "CLAMPED_SWIGLU")}
"""kernel -> constexprs whose nonzero form bounds their zero form (`representative`)."""


def _drop_superseded(configs: Sequence[KernelConfig]) -> List[KernelConfig]:
    """A configuration is dropped where the same launch with `_SUPERSEDED`'s constexprs set is
    compiled, its scenarios merged in: the FP8 GEMM with per-channel scales (GROUP_K 0) by the one
    with group scales (a second fp32 accumulator tile and a scale load per K tile more), the MoE
    gate / up kernel by its biased, clamped-SwiGLU form (two bias loads and the clamps more). Each
    bounds the other's registers and shared memory, as measured for every tile on sm_80 and sm_90
    (the MoE down kernel's biased form does not: it sometimes takes fewer registers, and both are
    compiled). Of the int8 weights' launches only the untimed first candidates are kept, and of the
    MoE kernels' timed candidates those of experts in the model dtype (the quantized forms run the
    same tiles with a weight tile decoded in registers; `timed_choice` skips one that fails)."""
    def twin(cfg: KernelConfig) -> Tuple:
        names = _SUPERSEDED[cfg.kernel]
        return cfg.kernel, tuple(p for p in cfg.key[1] if p[0] not in names), cfg.key[2], cfg.timed_only

    def bounding(cfg: KernelConfig) -> bool:
        return cfg.kernel in _SUPERSEDED and all(dict(cfg.key[1]).get(name) for name in _SUPERSEDED[cfg.kernel])

    bounds = {twin(c): c for c in configs if bounding(c)}
    out: List[KernelConfig] = []
    for cfg in configs:
        constexprs = dict(cfg.key[1])
        if cfg.timed_only and constexprs.get("INT_CODES"):
            continue  # int8 weights: the first candidate of each regime only (`timed_choice` skips a failed launch)
        if cfg.timed_only and cfg.kernel.startswith("_moe") and (constexprs.get("W_FP8") or constexprs.get("W_INT4")):
            continue  # quantized experts: their tiles' timed candidates are the model-dtype experts' ones
        bound = bounds.get(twin(cfg)) if cfg.kernel in _SUPERSEDED else None
        if bound is None or bound is cfg:
            out.append(cfg)
        else:
            bound.uses.extend(u for u in cfg.uses if u not in bound.uses)
    return out


def representative(configs: Sequence[KernelConfig]) -> List[KernelConfig]:
    """A smaller set for quick checks: of configurations that differ only in a GEMM's
    BLOCK_K, in the attention kernel's NUM_SPLITS (when > 1) or in a reduction's split
    count, keep the largest value (its scenarios are merged in). A GEMM's K tile scales
    its shared memory (stages x (BLOCK_M + BLOCK_N) x BLOCK_K) and its operand registers,
    so the largest BLOCK_K bounds the others (smaller K tiles come from INT4 group sizes
    32 / 64). NUM_SPLITS > 1 only enters the attention kernel's scalar arithmetic (loop
    bounds, partial offsets), not its tiles. The reductions' split counts (NUM_SPLITS:
    rows of the partials tile; SPLIT_K: an unrolled loop) grow their register use with
    the value. Timed-only GEMM candidates and configurations launched untimed are thinned
    separately (`KernelConfig.timed_only` keeps its meaning). Every other configuration
    is kept, less those `_drop_superseded` drops."""
    out: List[KernelConfig] = []
    best: Dict[Tuple, KernelConfig] = {}
    for cfg in _drop_superseded(configs):
        name = _DOMINATED.get(cfg.kernel)
        parts = dict(cfg.key[1])
        if name is None or (cfg.kernel == "_paged_attention_kernel" and parts[name] == 1):
            out.append(cfg)
            continue
        rest = (cfg.kernel, tuple(p for p in cfg.key[1] if p[0] != name), cfg.key[2], cfg.timed_only)
        kept = best.get(rest)
        if kept is None:
            best[rest] = cfg
            out.append(cfg)
            continue
        if parts[name] > dict(kept.key[1])[name]:
            cfg = dataclasses.replace(cfg, uses=list(cfg.uses))
            out[out.index(kept)] = cfg
            best[rest], kept, cfg = cfg, cfg, kept
        kept.uses.extend(u for u in cfg.uses if u not in kept.uses)
    return out


# ---------------------------------------------------------------------------------------------
# Compilation


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    config: str
    target: str
    ok: bool
    error: str = ""
    registers: int = 0
    spills: int = 0
    shared: int = 0
    num_warps: int = 0
    num_stages: int = 0
    smem_limit: int = 0
    warps_per_sm: int = 0
    occupancy_limit: str = ""

    @property
    def smem_ok(self) -> bool:
        return self.shared <= self.smem_limit

    @property
    def cell(self) -> str:
        """The result in a table cell: registers / thread, spilled words, shared KiB, resident warps
        per SM (limiter), and what is wrong."""
        if not self.ok:
            return f"FAIL: {self.error}"
        flags = (" SPILLS" if self.spills else "") + (" SMEM>LIMIT" if not self.smem_ok else "")
        return (f"{self.registers}r {self.spills}sp {self.shared / 1024:.1f}K {self.warps_per_sm}w "
                f"({self.occupancy_limit}){flags}")


_RESULTS: Dict[Tuple[str, Tuple], CompileResult] = {}  # (target, config key) -> result, for the process


def _resource_usage(cubin: bytes, kernel: str) -> Tuple[int, int]:
    """(registers per thread, local memory bytes per thread) of `kernel` in a cubin."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                              check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    match = re.search(rf"Function {re.escape(kernel)}:\s*REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)", text)
    if match is None:
        raise RuntimeError(f"no resource usage for {kernel} in cuobjdump output:\n{text}")
    return int(match.group(1)), int(match.group(2))


def _compile_here(cfg: KernelConfig, target: Target) -> CompileResult:
    """Compile `cfg` for `target` in this process, as a launch on that GPU would."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    launch = cfg.launch
    jit = launch.jit
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    # What JITFunction.run does before binding, then its binder and _pack_args (private
    # API of the pinned triton): the signature, constexprs and attributes of a real launch.
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton >= 3.7
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    common = dict(kernel=cfg.kernel, config=cfg.summary, target=target.name, num_warps=options.num_warps,
                  num_stages=options.num_stages, smem_limit=target.smem_per_block)
    try:
        compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=gpu,
                                  options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - a compile error is a result here
        return CompileResult(ok=False, error=_error_message(e), **common)
    regs, local = _resource_usage(compiled.asm["cubin"], compiled.metadata.name)
    shared = compiled.metadata.shared
    warps, limiter = occupancy(target, regs, shared, options.num_warps)
    return CompileResult(ok=True, registers=regs, spills=local // 4, shared=shared,
                         warps_per_sm=warps, occupancy_limit=limiter, **common)


def _error_message(e: BaseException) -> str:
    """The innermost cause's message (a CompilationError's own text is a source excerpt)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and ln.strip() != "^"]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def can_compile_in_process() -> bool:
    """False when triton.language was imported under TRITON_INTERPRET=1: its own @jit
    helpers (tl.zeros_like, tl.cdiv, ...) are then interpreter objects, and compiling a
    kernel that calls them fails (and leaves triton.language patched for the interpreter)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(tl.zeros_like, JITFunction)


TIMED_TARGET = "sm_90"
"""The one target whose timed-only GEMM candidates the reduced set compiles (`_configs`)."""


def _configs(target: Target, dtypes, models, reduced: bool) -> List[KernelConfig]:
    """The target's configurations; `reduced`: `representative`'s, and the timed-only GEMM candidates
    on TIMED_TARGET alone. Those are never what runs untimed and `timed_choice` skips one that fails
    to launch, so a failure elsewhere costs a candidate, not a request; the tiles and code paths they
    share with the first candidates are compiled on every target (the unthinned set: `--static`)."""
    configs = enumerate_configs(target, dtypes, models)
    if not reduced:
        return configs
    return [cfg for cfg in representative(configs) if target.name == TIMED_TARGET or not cfg.timed_only]


def compile_all(targets: Iterable[str] = tuple(TARGETS), dtypes: Iterable[torch.dtype] = DTYPES,
                models: Iterable[ModelShape] = MODELS, reduced: bool = False,
                jobs: Optional[int] = None) -> List[Tuple[KernelConfig, CompileResult]]:
    """Enumerate (`reduced`: then thin out with `representative`) and compile every
    configuration for each target: (config, result) pairs in order. Results are cached
    for the process. With `jobs` > 1 (default: PAGEDSERVE_AOT_JOBS, else the CPU count)
    the compiles are shared out among that many child processes; under TRITON_INTERPRET=1
    (see `can_compile_in_process`) they always run in children, without it."""
    targets, dtypes, models = tuple(targets), tuple(dtypes), tuple(models)
    todo = [(cfg, TARGETS[name]) for name in targets for cfg in _configs(TARGETS[name], dtypes, models, reduced)]
    missing = [(cfg, t) for cfg, t in todo if (t.name, cfg.key) not in _RESULTS]
    jobs = max(1, min(jobs or int(os.environ.get("PAGEDSERVE_AOT_JOBS", 0)) or os.cpu_count() or 1, len(missing)))
    if missing and jobs == 1 and can_compile_in_process():
        for cfg, t in missing:
            _RESULTS[(t.name, cfg.key)] = _compile_here(cfg, t)
    elif missing:
        rows = _compile_in_children(targets, dtypes, models, reduced, jobs)
        by_repr = {(t.name, repr(cfg.key)): (t.name, cfg.key) for cfg, t in todo}
        _RESULTS.update({by_repr[(r["target"], r["key"])]: CompileResult(**r["result"]) for r in rows})
    return [(cfg, _RESULTS[(t.name, cfg.key)]) for cfg, t in todo]


def _compile_in_children(targets, dtypes, models, reduced: bool, jobs: int) -> List[Dict[str, Any]]:
    """Run `jobs` children (`python -m pagedserve.kernels.triton.aot --shard i/jobs`, without
    TRITON_INTERPRET), each compiling every jobs-th configuration; their JSON rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for i in range(jobs):
            out, err = os.path.join(tmp, f"shard{i}.json"), os.path.join(tmp, f"shard{i}.err")
            cmd = [sys.executable, "-m", "pagedserve.kernels.triton.aot", "--json", out, "--shard", f"{i}/{jobs}",
                   "--targets", ",".join(targets), "--dtypes", ",".join(_dtype_name(d) for d in dtypes),
                   "--models", ",".join(m.name for m in models)] + ["--reduced"] * reduced
            with open(err, "w") as f:  # a file, not a pipe: a full pipe would stall the child
                children.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f), out, err))
        failures = []
        for child, out, err in children:
            if child.wait() != 0 or not os.path.exists(out):
                with open(err) as f:
                    # child.args: the list of str given to Popen (its annotation allows bytes and paths too)
                    label: str = child.args[-1]  # type: ignore[index,assignment]
                    failures.append(f"child {label} exited {child.returncode}:\n{f.read()[-3000:]}")
                continue
            with open(out) as f:
                rows += json.load(f)
    if failures:
        raise RuntimeError("AOT compile failed:\n" + "\n".join(failures))
    return rows


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m pagedserve.kernels.triton.aot --json PATH [--shard I/N] [...]`: compile (every N-th
    configuration from the I-th) and write the results as JSON; what `compile_all` runs in
    its children. For a table, see `python benchmarks/kernels.py --static`."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--json", required=True)
    p.add_argument("--shard", default="0/1")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--dtypes", default=",".join(_dtype_name(d) for d in DTYPES))
    p.add_argument("--models", default=",".join(m.name for m in MODELS))
    p.add_argument("--reduced", action="store_true", help="`representative` configurations only")
    args = p.parse_args(argv)
    if not can_compile_in_process():
        sys.exit("run without TRITON_INTERPRET=1")
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    models = [m for m in MODELS if m.name in args.models.split(",")]
    todo = [(cfg, TARGETS[name]) for name in args.targets.split(",")
            for cfg in _configs(TARGETS[name], dtypes, models, args.reduced)]
    i, n = (int(v) for v in args.shard.split("/"))
    rows = [{"target": t.name, "key": repr(cfg.key), "result": dataclasses.asdict(_compile_here(cfg, t))}
            for cfg, t in todo[i::n]]
    with open(args.json, "w") as f:
        json.dump(rows, f)


__all__ = [
    "CompileResult", "KernelConfig", "Launch", "MODELS", "ModelShape", "TARGETS", "Target",
    "can_compile_in_process", "compile_all", "decode_programs", "enumerate_configs", "occupancy", "programs_table",
    "representative", "resource_lines",
]


if __name__ == "__main__":
    main()
