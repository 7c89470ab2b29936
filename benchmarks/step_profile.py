"""Where an engine step's time goes: device time by kernel family and the device's idle time between
kernels, for decode steps at batch 1, 64 and 256 and one mixed step. A section of benchmarks/gpu.py.

torch.profiler (CPU and CUDA activities on a GPU; CPU only in the dry run) over the engine's own steps
(`LLMEngine.step`, the engine as served: compiled pieces, decode CUDA graphs and async scheduling
wherever the engine turns them on), one engine for every scenario:

  decode, batch B    B requests (random prompts: 512 tokens, 64 at batch 256) filled into the batch,
                     2 steps to warm, then `steps` consecutive decode steps profiled as one window,
                     the device synchronized at the window's ends only (the host's work overlaps the
                     device's as it does when serving)
  mixed              8 decoding requests, then a 2,048-token prompt added: the one step that runs its
                     prefill beside the 8 decodes, profiled alone (synchronized before it, so the
                     host's preparation of that step has nothing to hide behind), `repeats` times
                     with fresh prompts

Per scenario and step: the device's time by kernel family (`FAMILIES`: the first family one of whose
substrings is in the kernel's lower-cased name), in µs and as a share of the kernel time; kernels
launched; and the device's idle time: the window's wall time minus the union of its kernels'
intervals, the host's share of the step (Python, scheduling, launches not hidden behind kernels;
the profiler's own cost per recorded op adds a little). A kernel torch.compile fused from several
ops goes by its name's parts (inductor names it after them: `..._mean_mul_pow_rsqrt` is a norm).

On CPU (the dry run: a tiny model) the "kernels" are the window's top-level torch ops, each with its
children's CPU time inside it; the CPU backend's own C kernels run outside torch's dispatcher and
count as idle. The plumbing runs, the numbers mean nothing (the table says so).

    python benchmarks/step_profile.py [--device cpu]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import write_model_dir  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402

FAMILIES = (  # (family, substrings of a kernel's lower-cased name); the first family that matches
    ("GEMM", ("gemm", "matmul", "cutlass", "xmma", "nvjet", "gemv", "cublas", "splitk", "_w4a16", "_fp8_gemm",
              "per_token_quant", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("attention", ("attention", "flash", "fmha", "_split_reduce")),
    ("sampling", ("softmax", "topk", "sort", "argmax", "max_index", "sample", "multinomial", "exponential")),
    ("norm / rotary / activation", ("rms", "norm", "rotary", "rope", "silu", "gelu", "act_and_mul", "rsqrt")),
    ("copies", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter", "write_kv", "embedding", "fill",
                "aten::to")),
)
OTHER = "other"
FAMILY_NAMES = tuple(name for name, _ in FAMILIES) + (OTHER,)
WINDOW = "step_profile.window"


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((fam for fam, parts in FAMILIES if any(part in name for part in parts)), OTHER)


@dataclass(frozen=True)
class Scenario:
    name: str
    decodes: int
    prompt: int
    """Tokens of each decoding request's prompt."""
    prefill: int = 0
    """Tokens of the prompt whose prefill runs beside the decodes (0: decode steps only)."""


def scenarios(device: str) -> list[Scenario]:
    prompt, short = (512, 64) if device == "cuda" else (16, 8)  # the dry run: the same steps, shorter contexts
    return [Scenario("decode, batch 1", 1, prompt), Scenario("decode, batch 64", 64, prompt),
            Scenario("decode, batch 256", 256, short), Scenario("mixed: 8 decodes + a 2,048-token prefill", 8, prompt, 2048)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Driver:
    """Requests into one engine, steps run exactly, everything aborted after."""

    def __init__(self, engine: LLMEngine, device: str, seed: int = 0):
        self.engine, self.device = engine, device
        self.rng = random.Random(seed)
        self.ids: list[str] = []

    def add(self, count: int, prompt: int, max_tokens: int) -> None:
        vocab = self.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for _ in range(count):
            self.ids.append(self.engine.add_request([self.rng.randrange(3, vocab) for _ in range(prompt)], params))

    def fill(self, decodes: int, limit: int = 64) -> None:
        """Step until a step decodes all `decodes` requests and prefills nothing."""
        for _ in range(limit):
            self.engine.step()
            last = self.engine.scheduler.last_step
            if last.context_requests == 0 and last.generation_requests == decodes and not self.engine.scheduler.num_waiting:
                return
        raise RuntimeError(f"the batch of {decodes} did not fill in {limit} steps ({self.engine.scheduler.last_step})")

    def steps(self, count: int) -> list[tuple[int, int]]:
        """`count` steps; (prompt tokens, decoding requests) of each."""
        ran = []
        for _ in range(count):
            self.engine.step()
            last = self.engine.scheduler.last_step
            ran.append((last.context_tokens, last.generation_requests))
        return ran

    def clear(self) -> None:
        for request_id in self.ids:
            self.engine.abort(request_id)
        self.ids.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        sync(self.device)


def run_scenario(driver: Driver, scenario: Scenario, steps: int, repeats: int) -> tuple[list, list]:
    """Profile one scenario; (the profiler's events, what each profiled step ran)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = driver.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    max_tokens = 64 + steps + 4 * repeats  # outlives the fill, the warm-up and every window
    driver.add(scenario.decodes, scenario.prompt, max_tokens)
    driver.fill(scenario.decodes)
    driver.steps(2)
    ran: list[tuple[int, int]] = []
    with profile(activities=activities) as prof:
        for _ in range(repeats if scenario.prefill else 1):
            if scenario.prefill:
                driver.add(1, scenario.prefill, 1)
            sync(device)
            with record_function(WINDOW):
                ran += driver.steps(1 if scenario.prefill else steps)
                sync(device)
            if scenario.prefill:
                driver.steps(2)  # the prompt's one token lands and it finishes
    driver.clear()
    return list(prof.events()), ran


def summarize(events: list, device: str) -> dict:
    """Per step (over every window): wall, device busy, idle, kernels, and time by family."""
    try:
        from torch.autograd import DeviceType
    except ImportError:  # an older torch
        from torch._C._autograd import DeviceType

    def annotation(event) -> bool:  # a record_function range (the window's own twin on the GPU timeline too)
        return event.name == WINDOW or bool(getattr(event, "is_user_annotation", False))

    windows = [e for e in events if e.name == WINDOW and e.device_type == DeviceType.CPU]
    if device == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not annotation(e)]
    else:
        threads = {w.thread for w in windows}
        kernels = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async and not annotation(e)
                   and e.thread in threads and _top_level(e, annotation)]
    wall = busy = total = 0.0
    count = 0
    by_family = dict.fromkeys(FAMILY_NAMES, 0.0)
    for window in windows:
        start, end = window.time_range.start, window.time_range.end
        inside = [k for k in kernels if start <= k.time_range.start < end]
        for k in inside:
            by_family[family(k.name)] += k.time_range.elapsed_us()
        total += sum(k.time_range.elapsed_us() for k in inside)
        busy += _union([(k.time_range.start, min(k.time_range.end, end)) for k in inside])
        wall += end - start
        count += len(inside)
    return dict(wall_us=wall, busy_us=busy, kernel_us=total, kernels=count, families=by_family, windows=len(windows))


def _top_level(event, annotation) -> bool:
    """No torch op above it (record_function ranges, like the window, do not count)."""
    parent = event.cpu_parent
    while parent is not None:
        if not annotation(parent):
            return False
        parent = parent.cpu_parent
    return True


def _union(intervals: list[tuple[float, float]]) -> float:
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def _row(scenario: Scenario, device: str, summary: dict, ran: list[tuple[int, int]], graphs: bool) -> dict:
    steps = max(len(ran), 1)
    kernel_us = summary["kernel_us"]
    families = {name: dict(us=round(us / steps, 1), share=round(us / kernel_us, 4) if kernel_us else 0.0)
                for name, us in summary["families"].items()}
    wall, idle = summary["wall_us"] / steps, (summary["wall_us"] - summary["busy_us"]) / steps
    return dict(scenario=scenario.name, decodes=scenario.decodes, prompt=scenario.prompt, prefill=scenario.prefill,
                device=device, steps=len(ran), ran=sorted(set(ran)), decode_graphs=graphs,
                wall_us=round(wall, 1), kernel_us=round(kernel_us / steps, 1), idle_us=round(idle, 1),
                idle_share=round(idle / wall, 4) if wall else None, kernels=round(summary["kernels"] / steps, 1),
                families=families, note=_note(scenario, summary, ran))


def _note(scenario: Scenario, summary: dict, ran: list[tuple[int, int]]) -> str | None:
    """What went otherwise than planned, if anything."""
    if not summary["kernels"]:
        return "no kernels recorded in the window"
    if set(ran) != {(scenario.prefill, scenario.decodes)}:
        return f"steps ran (prompt tokens, decodes): {sorted(set(ran))}"
    return None


def _missing(scenario: Scenario, device: str, note: str) -> dict:
    return dict(scenario=scenario.name, decodes=scenario.decodes, prompt=scenario.prompt, prefill=scenario.prefill,
                device=device, steps=0, families={}, note=note)


def rows(model: str, device: str, steps: int = 5, repeats: int = 3, seconds: float = 50.0,
         progress=print) -> list[dict]:
    """One row per scenario (see the module docstring) on the model directory `model` (random weights)."""
    started = time.perf_counter()
    engine = LLMEngine(model=model, load_format="dummy", device=device, dtype="bfloat16", max_num_seqs=256,
                       max_num_batched_tokens=8192, enable_prefix_caching=False, gpu_memory_utilization=0.55,
                       kv_cache_bytes=64 * 2**20, max_model_len=4096)
    graphs = getattr(engine.runner, "graphs", None) is not None
    progress(f"step profile: engine ready in {time.perf_counter() - started:.1f} s")
    driver = Driver(engine, device)
    table: list[dict] = []
    broken = ""
    try:
        for scenario in scenarios(device):
            if broken or time.perf_counter() - started > seconds:
                table.append(_missing(scenario, device, broken or f"not measured: past the section's {seconds:.0f} s"))
                continue
            try:
                events, ran = run_scenario(driver, scenario, steps, repeats)
            except Exception as error:  # noqa: BLE001 - the other scenarios still run
                table.append(_missing(scenario, device, f"failed: {type(error).__name__}: {str(error)[:160]}"))
                driver.ids.clear()
                try:
                    engine.recover_from_failure()
                except Exception:  # noqa: BLE001 - the engine is past saving: the scenarios left say so
                    broken = "not measured: the engine failed in the scenario before"
                continue
            table.append(_row(scenario, device, summarize(events, device), ran, graphs))
            progress(f"step profile: {scenario.name}: {table[-1]['wall_us']:,.0f} us a step, "
                     f"{table[-1]['idle_share'] or 0:.0%} idle")
    finally:
        engine.close()
        del driver, engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return table


def markdown(table: list[dict]) -> str:
    cpu = any(row["device"] == "cpu" for row in table)
    lines = ["Engine steps by kernel family (µs a step, share of the kernel time); idle: the step's wall time not "
             "covered by a kernel (the host's share)"
             + (" (CPU dry run: the 'kernels' are top-level torch ops of a tiny model, numbers meaningless)" if cpu else "")
             + ".", "",
             "| scenario | steps | step (µs) | kernels / step | idle (µs, share) | "
             + " | ".join(FAMILY_NAMES) + " |", "|---|---:|---:|---:|---:|" + "---:|" * len(FAMILY_NAMES)]
    for row in table:
        if not row["steps"]:
            lines.append(f"| {row['scenario']} | 0 | {row['note']} |")
            continue
        cells = " | ".join(f"{row['families'][name]['us']:,.0f} ({row['families'][name]['share']:.0%})"
                           for name in FAMILY_NAMES)
        lines.append(f"| {row['scenario']} | {row['steps']} | {row['wall_us']:,.0f} | {row['kernels']:g} "
                     f"| {row['idle_us']:,.0f} ({row['idle_share']:.0%}) | {cells} |")
    graphs = [row for row in table if row.get("decode_graphs")]
    if graphs:
        lines += ["", "Decode steps replay CUDA graphs (as served)."]
    lines += [f"- {row['scenario']}: {row['note']}" for row in table if row.get("note") and row["steps"]]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    shape = "llama-3-8b" if args.device == "cuda" else "tiny"
    with tempfile.TemporaryDirectory() as root:
        print(markdown(rows(write_model_dir(shape, os.path.join(root, shape)), args.device)))
