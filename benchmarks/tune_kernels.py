"""The kernel tuning sweep a lent GPU runs once: every Triton launch's configurations timed at the
shapes that matter, the fastest written to `kernels/triton/configs/<GPU name>.json`, which the
engine reads at load (kernels/triton/tuned.py) instead of timing on the request path.

    python benchmarks/tune_kernels.py                       # a GPU, at most --budget seconds (480)
    python benchmarks/tune_kernels.py --quick               # the 8B's decode sizes first, ~3 minutes
    python benchmarks/tune_kernels.py --device cpu --out D  # the same code on tiny shapes (make test)

What is swept, in this order (a run cut by its budget keeps what it finished, and the file keeps
the entries an earlier run wrote for keys this one did not reach):
  1. Llama-3-8B's quantized linears (qkv, o, gate_up, down) at M = 1, 2, 4, 8, 16: the int4
     (AWQ group 128) and the fp8 weight GEMMs, in the mode this GPU runs (`default_mode`);
  2. the same at M = 32 .. 2048; 3. the bundled model's shape (SmolLM2-135M: its GGUF group 32
     and group 64) at every M; 4. the fused MoE kernels (Mixtral-8x7B's and Qwen3-30B-A3B's
     experts, in the model dtype) at 1 .. 2048 tokens; 5. the batched LoRA kernels on the 8B's
     linears (4 slots, rank 16) at 1 .. 256 tokens.
Per key the space is the launcher's own candidates (the GEMV kernels, split-K and whole-K
tiles, cuBLASLt's `torch._scaled_mm` for fp8, cuBLAS after a dequantization for int4 at prompt
sizes) and a wider set of tiles, warps and stages around them (`space`). Each is timed with
triton.testing.do_bench (L2 flushed between runs, as a decode step's weights are not in L2);
one that fails to compile or launch (shared memory) is skipped. Every key's line shows the
chosen configuration against the launcher's untimed default.

Bias-free linears in bfloat16, the engine's CUDA dtype (a float16 engine, or one with biased
projections, keys differently and keeps today's heuristics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run in its interpreter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import commit, importable_checkout  # noqa: E402

importable_checkout()
from pagedserve.kernels.triton import aot, tuned  # noqa: E402
from pagedserve.kernels.triton import fp8 as fp8_gemm, int4 as int4_gemm, lora as lora_kernels, moe as moe_kernels  # noqa: E402
from pagedserve.kernels.triton.gemm import GemmConfig, bucket_m  # noqa: E402

DECODE_MS = (1, 2, 4, 8, 16)
PROMPT_MS = (32, 64, 128, 256, 512, 2048)
MOE_TOKENS = (1, 4, 16, 64, 256, 2048)
LORA_TOKENS = (1, 4, 16, 64, 256)
LORA_RANK = 16


@dataclasses.dataclass
class Job:
    """One key to tune: its launcher key, the configurations to time and how to run one."""

    label: str
    key: Tuple
    space: List[GemmConfig]
    run: Callable[[GemmConfig], object]


# -- the space around each launcher's candidates -----------------------------------------------

def _fit(cfg: GemmConfig, group: int, k: int) -> Optional[GemmConfig]:
    """`cfg` with its K tile halved until it lies inside a group and divides K (None below 16)."""
    bk = cfg.block_k
    while bk >= 16 and ((group and group % bk) or k % bk):
        bk //= 2
    return dataclasses.replace(cfg, block_k=bk) if bk >= 16 else None


def gemm_space(candidates: List[GemmConfig], m: int, k: int, group: int, quick: bool) -> List[GemmConfig]:
    """The launcher's candidates, then tiles around them: for decode-sized M (16-row tiles) more
    column widths, K tiles, stages and the heuristic's split-K against whole-K; for prompt sizes
    the square tiles at more stages. Duplicates and tiles whose K tile leaves a group dropped."""
    extra: List[GemmConfig] = []
    if m <= 16:
        for bn, warps in ((32, 4), (64, 4), (128, 4), (128, 8), (256, 8)):
            for bk in (64, 128, 256):
                for stages in ((4,) if quick else (3, 5)):
                    for split in (None, 1):
                        extra.append(GemmConfig(16, bn, bk, warps, stages, split_k=split))
    else:
        for bm, bn, warps in ((32, 64, 4), (64, 64, 4), (64, 128, 4), (128, 128, 8), (128, 256, 8)):
            if bm > 2 * m and bm > 32:
                continue
            for bk in (64, 128):
                for stages in ((3,) if quick else (2, 3, 4)):
                    extra.append(GemmConfig(bm, bn, bk, warps, stages))
    out: List[GemmConfig] = list(candidates)  # the launcher's own, as they are
    for cfg in extra:
        fitted = _fit(cfg, group, k)
        if fitted is not None and fitted not in out:
            out.append(fitted)
    return out


def moe_space(candidates: List[GemmConfig], quick: bool) -> List[GemmConfig]:
    """The MoE launcher's candidates and more row / column tiles of its regime."""
    decode = candidates[0].block_m == 16
    rows = (16, 32) if decode else (64, 128)
    extra = [GemmConfig(bm, bn, bk, warps, stages) for bm in rows for bn in (64, 128) for bk in (64, 128)
             for warps, stages in (((4, 3),) if quick else ((4, 2), (4, 3), (8, 4)))]
    return list(dict.fromkeys(candidates + extra))


def lora_space(default: GemmConfig) -> List[GemmConfig]:
    """Row tiles, the expand kernel's column tile and the shrink kernel's K tile, warps and stages."""
    space = [default]
    for bm in (16, 32, 64):
        for bn in (64, 128):
            for bk in (64, 128):
                for warps, stages in ((4, 2), (4, 3), (8, 3)):
                    space.append(GemmConfig(bm, bn, bk, warps, stages))
    return list(dict.fromkeys(space))


# -- the jobs ------------------------------------------------------------------------------------

def _linear_jobs(model: aot.ModelShape, ms: Tuple[int, ...], groups: Callable[[int], List[int]], device: torch.device,
                 dtype: torch.dtype, quick: bool) -> Iterator[Job]:
    """int4 and fp8 GEMM jobs for every linear of `model` at every M (weights made lazily, once a shape)."""
    from pagedserve.kernels.fp8 import quantize_fp8
    from pagedserve.kernels.int4 import quantize_int4

    mode = fp8_gemm.default_mode(device)
    for layer, (n, k) in model.linears().items():
        weight = torch.randn(n, k, device=device) * 0.02
        w4s = {g: quantize_int4(weight, g, scale_dtype=dtype) for g in groups(k)}
        w8 = quantize_fp8(weight)
        del weight
        for m in ms:
            x = torch.randn(m, k, device=device).to(dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            for g, w4 in w4s.items():
                key = ("w4a16", device, bucket_m(m), n, k, g, dtype, False)
                yield Job(f"{model.name} {layer} int4 g{g} M={m}", key,
                          gemm_space(int4_gemm._candidates(m, n, k, g), m, k, g, quick),
                          lambda c, x=x, w=w4, o=out: int4_gemm._launch(x, w, None, o, c))
            key = ("fp8", device, bucket_m(m), n, k, dtype, mode, False, 0, w8.CODES)
            candidates = fp8_gemm._candidates(m, n, k, mode)
            if mode == "fp8" and device.type == "cuda" and hasattr(torch, "_scaled_mm"):
                candidates.append(fp8_gemm.SCALED_MM)
            yield Job(f"{model.name} {layer} fp8 {mode} M={m}", key, gemm_space(candidates, m, k, 0, quick),
                      lambda c, x=x, w=w8, o=out: fp8_gemm._run(x, w, None, o, c, mode))


def _moe_jobs(shape: aot.MoeShape, device: torch.device, dtype: torch.dtype, quick: bool) -> Iterator[Job]:
    from pagedserve.kernels.moe import ExpertWeights

    experts = ExpertWeights((torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device) * 0.02).to(dtype),
                            (torch.randn(shape.experts, shape.hidden, shape.inter, device=device) * 0.02).to(dtype))
    for tokens in MOE_TOKENS:
        x = torch.randn(tokens, shape.hidden, device=device).to(dtype)
        weights = torch.full((tokens, shape.top_k), 1.0 / shape.top_k, device=device)
        ids = torch.stack([torch.randperm(shape.experts, device=device)[:shape.top_k] for _ in range(tokens)])
        pairs = tokens * shape.top_k
        candidates = moe_kernels._candidates(pairs, shape.experts, 0)
        key = ("moe", device, bucket_m(pairs), candidates[0].block_m, shape.experts, shape.hidden, shape.inter,
               experts.form, 0, dtype, False, False)
        yield Job(f"{shape.name} experts tokens={tokens}", key, moe_space(candidates, quick),
                  lambda c, x=x, w=weights, i=ids: moe_kernels._launch(x, experts, w, i, c))


def _lora_jobs(model: aot.ModelShape, device: torch.device, dtype: torch.dtype) -> Iterator[Job]:
    slots = aot.LORA_SLOTS
    for layer, (n, k) in model.linears().items():
        a = (torch.randn(slots, LORA_RANK, k, device=device) * 0.02).to(dtype)
        b = (torch.randn(slots, n, LORA_RANK, device=device) * 0.02).to(dtype)
        scaling = torch.ones(slots, device=device)
        for tokens in LORA_TOKENS:
            x = torch.randn(tokens, k, device=device).to(dtype)
            out = torch.zeros(tokens, n, device=device, dtype=dtype)
            token_slots = torch.arange(tokens, device=device) % slots
            default = lora_kernels.lora_config(tokens, slots)
            key = ("lora", device, bucket_m(tokens), default.block_m, slots, LORA_RANK, k, n, dtype)
            yield Job(f"{model.name} {layer} LoRA r{LORA_RANK} tokens={tokens}", key, lora_space(default),
                      lambda c, x=x, a=a, b=b, o=out, s=scaling, t=token_slots:
                      lora_kernels.add_lora_triton(o, x, a, b, s, t, config=c))


TINY = aot.ModelShape("tiny", 64, 2, 1, 32, 96, 256)
"""The CPU dry run's model: linears of 64..128 columns, small enough for the interpreter."""


def jobs(device: torch.device, dtype: torch.dtype, quick: bool) -> Iterator[Job]:
    """Every job in the order of the module docstring (the CPU dry run: the tiny shape at M = 1
    and 16, one MoE and one LoRA key)."""
    from pagedserve.kernels.int4 import int4_group_size

    if device.type == "cpu":
        yield from _linear_jobs(TINY, (1, 16), lambda k: [32], device, dtype, quick)
        yield from (job for job in _moe_jobs(aot.MoeShape("tiny", 64, 32, 4, 2), device, dtype, quick)
                    if job.key[2] == 2)
        yield from (job for job in _lora_jobs(TINY, device, dtype) if job.key[2] == 1 and "o_proj" in job.label)
        return
    llama, smol = (next(m for m in aot.MODELS if m.name == name) for name in ("Llama-3-8B", "SmolLM2-135M"))
    yield from _linear_jobs(llama, DECODE_MS, lambda k: [int4_group_size(k)], device, dtype, quick)
    yield from _linear_jobs(llama, PROMPT_MS, lambda k: [int4_group_size(k)], device, dtype, quick)
    yield from _linear_jobs(smol, DECODE_MS + PROMPT_MS, lambda k: sorted({aot.GGUF_GROUP_SIZE, int4_group_size(k)}),
                            device, dtype, quick)
    for shape in aot.MOE_MODELS:
        if not shape.gpt_oss:
            yield from _moe_jobs(shape, device, dtype, quick)
    yield from _lora_jobs(llama, device, dtype)


# -- timing --------------------------------------------------------------------------------------

def time_us(run: Callable[[], object], device: torch.device) -> float:
    """Median microseconds of one launch: do_bench on a GPU, one timed run in the interpreter."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(run, warmup=5, rep=15) * 1e3
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e6


def tune(job: Job, device: torch.device, max_configs: Optional[int]) -> Optional[Dict]:
    """The fastest configuration of `job` as a file entry, or None where none ran."""
    timings: List[Tuple[float, GemmConfig]] = []
    for cfg in job.space[:max_configs]:
        try:
            job.run(cfg)  # compile (and catch a launch failure) outside the timing
            timings.append((time_us(lambda: job.run(cfg), device), cfg))  # noqa: B023 - used in this iteration
        except Exception as error:  # noqa: BLE001 - a configuration this GPU cannot launch is skipped
            print(f"    skipped {cfg}: {type(error).__name__}: {str(error)[:120]}", flush=True)
    if not timings:
        return None
    best_us, best = min(timings, key=lambda t: t[0])
    default_us = next((t for t, c in timings if c == job.space[0]), float("nan"))
    return tuned.entry(job.key, best, us=round(best_us, 2), default_us=round(default_us, 2), tried=len(timings))


def describe(cfg: Dict) -> str:
    if cfg["block_m"] == 0:
        return cfg["variant"] or "torch._scaled_mm"
    split = "auto" if cfg["split_k"] is None else cfg["split_k"]
    text = f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']} split={split}"
    return text + (f" {cfg['variant']}" if cfg["variant"] else "")


def main(argv: Optional[List[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer stages and warps a tile")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole sweep")
    parser.add_argument("--out", default=str(tuned.CONFIG_DIR), help="folder of the per-GPU files")
    parser.add_argument("--max-configs", type=int, default=None, help="time at most this many configurations a key")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; use --device cpu for the dry run")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu dry run"
    capability = "sm_%d%d" % torch.cuda.get_device_capability(device) if device.type == "cuda" else "interpreter"
    max_configs = args.max_configs or (3 if device.type == "cpu" else None)
    path = os.path.join(args.out, tuned.file_name(name))
    started = time.perf_counter()
    previous: Dict[str, Dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = {tuned.key_text(item["key"]): item for item in json.load(f).get("choices", [])}
    import triton

    data = dict(device=name, capability=capability, triton=triton.__version__, torch=torch.__version__, commit=commit(),
                date=time.strftime("%Y-%m-%d"), budget_s=args.budget, complete=False, choices=[])
    chosen: Dict[str, Dict] = {}

    def save() -> None:
        merged = {**previous, **chosen}
        data["choices"] = [merged[k] for k in sorted(merged)]
        data["seconds"] = round(time.perf_counter() - started, 1)
        os.makedirs(args.out, exist_ok=True)
        partial = f"{path}.tmp{os.getpid()}"
        with open(partial, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(partial, path)

    done = 0
    torch.manual_seed(0)
    for job in jobs(device, torch.bfloat16, args.quick):
        if time.perf_counter() - started > args.budget:
            print(f"budget of {args.budget:.0f} s spent after {done} keys; the rest keep their earlier entries "
                  "or the launch heuristics", flush=True)
            break
        result = tune(job, device, max_configs)
        done += 1
        if result is None:
            print(f"[{done}] {job.label}: no configuration ran", flush=True)
            continue
        chosen[tuned.key_text(result["key"])] = result
        print(f"[{done}] {job.label}: {result['us']:.1f} us with {describe(result['config'])} "
              f"(default {result['default_us']:.1f} us, {result['tried']} tried, {time.perf_counter() - started:.0f} s)",
              flush=True)
        if done % 10 == 0:
            save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    else:
        data["complete"] = True
    save()
    print(f"wrote {len(data['choices'])} choices for {name} to {path} in {data['seconds']:.0f} s", flush=True)
    return data


if __name__ == "__main__":
    main()
