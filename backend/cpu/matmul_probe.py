"""How fast this CPU multiplies in bf16 and in float32 (each float32 weight layout).

Measured, not read off the CPU flags, because the flags do not tell: with the same
avx512_bf16 flag and no AMX, an Intel Xeon ran the model's bf16 matmuls slower than
float32's at batch sizes, while an AMD EPYC ran them far faster than float32's at every
row count (benchmarks/RESULTS.md, "Xeon (no AMX): bf16 and float32 matmuls" and "fp8 KV
cache perplexity and the CPU float32 layouts"). float32's best layout differs the same way:
MKL over a transposed [in, out] copy won at one row on the Xeon, oneDNN's packed
layout won everywhere on the EPYC (MKL takes a slow path on AMD).

Where oneDNN's packed float32 measures faster (`weight_layouts`), the model takes it for
batches and keeps the plain weight beside it for steps of a few rows, which the C
matrix-vector loop (kernels/cpu/gemv.py) streams faster than oneDNN or MKL: the "both"
layout. The LM head always can (its plain weight is the tied embedding's, or takes the
place of the transposed copy MKL would need); the decoder layers do where their second
copy takes at most PLAIN_COPY_MAX_MEMORY of the machine's memory, else they keep only the
packed one. (Whatever the layout, a float32 weight that is exactly a GGUF Q4_1 or Q8_0 one
is multiplied through those blocks at every row count instead: backend/cpu/linear_methods.py.
So for a checkpoint of such blocks, as the bundled one is, float32 is timed through them: on an
AMD EPYC with avx512_bf16 oneDNN's bf16 beat its float32 by far, while the blocks run a
single stream's float32 steps from a sixth of the bytes.)
Engines with an fp8 KV cache keep the decoder layers transposed: its perplexity bound
(tests/test_quantization.py, 2% over float32) was set with MKL's summation order, and with
oneDNN's the bundled model's rose 2.04% on one EPYC (1.32% with MKL's; 1.80% vs 1.74% on
another). The LM head writes no cache, so it takes oneDNN's layout there too.

The probe times the model's gate/up projection (its largest matmul per layer) as the
engine runs it (backend/cpu/linear_methods.py: bf16 through the C AVX512-BF16 kernel where the
CPU has that instruction, else oneDNN's), at one row (a single stream's decode) and 32
rows (a batch's), in each candidate; quick for a small model. The verdict
is kept in the cache directory, keyed by CPU, torch version, threads and shape, so a
restart reads it instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch

from pagedserve.kernels.cache_dir import cache_root
from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu, gemv as gemv_cpu
from pagedserve.kernels.cpu.block_matmul import grid_weight
from pagedserve.kernels.cpu.native_build import cpu_signature

from ..model_config import ModelConfig
from ..models.linear import Linear
from .linear_methods import WeightLayouts, pack

logger = logging.getLogger("pagedserve")

PROBE_ROWS = (1, 32)
MAX_PROBE_ELEMENTS = 1 << 25
"""Weights larger than this (128 MiB in float32) are probed at this size: the ratio is
what matters, and it holds once the weight is far beyond the caches."""
PLAIN_COPY_MAX_MEMORY = 0.125
"""The share of the machine's memory a second (plain) copy of the float32 decoder layers may
take for the faster single-stream decode it buys (a 135M-parameter model: ~0.4 GiB)."""
CACHE_FILE = "matmul_probe.json"
_measured: dict[str, "MatmulTimes"] = {}
"""This process's verdicts by cache key."""


@dataclass(frozen=True)
class MatmulTimes:
    """Seconds for one call at each of PROBE_ROWS, summed, per candidate."""

    in_features: int
    out_features: int
    bfloat16: float
    float32_transposed: float
    float32_onednn: float
    float32_blocks: float | None = None
    """Through the checkpoint's own GGUF blocks, where it has them (None: it has not)."""

    @property
    def float32(self) -> float:
        """float32 as engines run it: through the blocks where the checkpoint has them (whatever
        the layout), else in the faster layout (see the module docstring)."""
        if self.float32_blocks is not None:
            return self.float32_blocks
        return min(self.float32_transposed, self.float32_onednn)

    def summary(self) -> str:
        blocks = "" if self.float32_blocks is None else f" / {self.float32_blocks * 1e3:.2f} ms GGUF blocks (C)"
        bf16 = f"C, {bf16_matmul_cpu.instructions()}" if bf16_matmul_cpu.native() else "oneDNN"
        return (f"[{self.in_features} -> {self.out_features}] matmul at {' and '.join(map(str, PROBE_ROWS))} rows: "
                f"bfloat16 {self.bfloat16 * 1e3:.2f} ms ({bf16}), "
                f"float32 {self.float32_transposed * 1e3:.2f} ms transposed "
                f"(MKL) / {self.float32_onednn * 1e3:.2f} ms packed (oneDNN){blocks}")


def probe_shape(config: ModelConfig) -> tuple[int, int]:
    """The gate/up projection's [in, out], shrunk to MAX_PROBE_ELEMENTS."""
    in_features, out_features = config.hidden_size, 2 * config.intermediate_size
    return in_features, max(64, min(out_features, MAX_PROBE_ELEMENTS // in_features))


def matmul_times(config: ModelConfig) -> MatmulTimes:
    """This CPU's times for the model's probe shape: from the cache, else measured (and cached)."""
    in_features, out_features = probe_shape(config)
    key = _cache_key(in_features, out_features, config.source_block_format)
    if key in _measured:  # dtype auto then the float32 layout ask twice; the disk may be unwritable
        return _measured[key]
    cached = _read_cache().get(key)
    try:
        times = MatmulTimes(**cached) if cached is not None else None
    except TypeError:  # written by another version: measure again
        times = None
    if times is None:
        times = measure(in_features, out_features, config.source_block_format)
        _write_cache(key, times)
    _measured[key] = times
    return times


def weight_layouts(config: ModelConfig, dtype: torch.dtype, device: torch.device, fp8_kv_cache: bool) -> WeightLayouts:
    """`pack_weights`' float32 layouts for an engine (see the module docstring), logged with the times behind them."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return WeightLayouts()
    times = matmul_times(config)
    if times.float32_onednn >= times.float32_transposed:
        logger.info("float32 weights: transposed (MKL), measured faster: %s", times.summary())
        return WeightLayouts()
    if gemv_cpu.LIBRARY.get() is None:
        few_rows = "one row through MKL's transposed copy"
        layouts = WeightLayouts(layers="transposed" if fp8_kv_cache else "onednn", lm_head="transposed")
    else:
        few_rows = f"up to {gemv_cpu.GEMV_MAX_ROWS} rows through the C GEMV over the plain weight"
        plain_copy_fits = decoder_weight_bytes(config) <= PLAIN_COPY_MAX_MEMORY * physical_memory()
        layouts = WeightLayouts(layers="transposed" if fp8_kv_cache else "both" if plain_copy_fits else "onednn",
                                lm_head="both")
    layers = {"transposed": "transposed (MKL: the fp8 KV cache's order)", "both": f"oneDNN-packed, {few_rows}",
              "onednn": "oneDNN-packed (a plain copy too would take over "
                        f"{PLAIN_COPY_MAX_MEMORY:.0%} of memory)"}[layouts.layers]
    logger.info("float32 weights: decoder layers %s; LM head oneDNN-packed for batches, %s; measured %s",
                layers, few_rows if layouts.lm_head == "both" else "transposed (MKL)", times.summary())
    return layouts


def decoder_weight_bytes(config: ModelConfig) -> int:
    """float32 bytes of the decoder layers' linear weights."""
    per_layer = config.hidden_size * (2 * config.q_size + 2 * config.kv_size + 3 * config.intermediate_size)
    return 4 * config.num_layers * per_layer


def physical_memory() -> int:
    """Bytes of memory this machine has (0 where the OS does not say: no plain copy then)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure(in_features: int, out_features: int, block_format: str | None = None, rounds: int = 5,
            calls: int = 4) -> MatmulTimes:
    """Time each candidate, interleaved round by round so that a burst of other work on the
    machine hits all of them; each keeps its best round. `block_format`: also a weight in those
    GGUF blocks, which a float32 Linear multiplies through them (the checkpoint's own format)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    candidates = {
        "bfloat16": _packed_linear(weight, torch.bfloat16),
        "float32_transposed": _packed_linear(weight, torch.float32, "transposed"),
        "float32_onednn": _packed_linear(weight, torch.float32, "onednn"),
    }
    if block_format is not None:
        candidates["float32_blocks"] = _packed_linear(grid_weight(block_format, out_features, in_features, seed=0),
                                                      torch.float32)
    inputs = {rows: torch.randn(rows, in_features, generator=generator) for rows in PROBE_ROWS}
    best = dict.fromkeys(candidates, float("inf"))
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 warms up (oneDNN builds its kernels)
            for name, linear in candidates.items():
                elapsed = 0.0
                for x in inputs.values():
                    x = x.to(linear.weight.dtype)
                    started = time.perf_counter()
                    for _ in range(calls):
                        linear(x)
                    elapsed += (time.perf_counter() - started) / calls
                if round_:
                    best[name] = min(best[name], elapsed)
    return MatmulTimes(in_features, out_features, **best)


def _packed_linear(weight: torch.Tensor, dtype: torch.dtype, float32_layout: str = "transposed") -> Linear:
    linear = Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    pack(linear, float32_layout)
    return linear


def _cache_key(in_features: int, out_features: int, block_format: str | None) -> str:
    cpu = hashlib.sha256(cpu_signature().encode()).hexdigest()[:16]
    blocks = f" blocks {block_format}" if block_format else ""
    pairs = " bf16 C kernel" if bf16_matmul_cpu.native() else ""  # oneDNN's bf16 verdict does not hold for it
    return (f"cpu {cpu} torch {torch.__version__} threads {torch.get_num_threads()} "
            f"shape {in_features}x{out_features} rows {','.join(map(str, PROBE_ROWS))}{blocks}{pairs}")


def _read_cache() -> dict:
    try:
        with open(cache_root() / CACHE_FILE) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, times: MatmulTimes) -> None:
    """Best effort: an unwritable cache only means measuring again next time."""
    path = cache_root() / CACHE_FILE
    data = _read_cache()
    data[key] = asdict(times)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
    except OSError as exc:
        logger.info("matmul probe: could not cache its times in %s (%s); it measures again next start", path, exc)
