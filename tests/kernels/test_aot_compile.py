"""Every Triton kernel configuration compiled for A100 (sm_80), L40S/L4 (sm_89) and H100
(sm_90) on the CPU, ahead of time (kernels/triton/aot.py), and checked: it compiles, it does not
spill registers, its shared memory fits the target. No GPU is needed, none is skipped.

The interpreter tests run the kernels' logic but accept code the compiler rejects (an
fp8 type sm_80 lacks, loop-carried type changes, dot shapes), and say nothing about
registers or shared memory; this is the check a GPU-less CI can make of those.

What is compiled (budget: a few minutes on a 2-core CPU, cold Triton cache): the
configurations the launchers choose for `aot.MODELS` (Llama-3-8B, SmolLM2-135M, Mistral-7B's
sliding window, Gemma-2-9B's head dim 256 and soft cap, gpt-oss-20b's attention sinks) and
`aot.MOE_MODELS` (the fused MoE kernels, gpt-oss's biased experts among them), with bfloat16
activations (the engine's CUDA default) on every target and float32 ones on sm_89 (attention
and cache write only: the quantized GEMMs and MoE take 16-bit activations; float32 tiles are
the largest in shared memory, and sm_89 has the least of it), thinned by `aot.representative`:
of GEMM configs differing only in BLOCK_K the largest is compiled (it bounds the smaller K
tiles of INT4 group sizes 32 / 64 in shared memory and registers), of FP8 GEMM configs
differing only in per-channel vs group scales the grouped one (it bounds the other; so does
the MoE gate / up kernel's biased form its plain one), of attention configs differing only in
NUM_SPLITS > 1 the largest (the value enters scalar arithmetic only), of the reductions' split
counts the largest. That is every tile shape, warp / stage count, split-K / split-KV / fp8 /
window / soft-cap / sink branch of every kernel. Timed-only GEMM candidates (never the untimed
first candidate; `timed_choice` skips one that fails to launch) are compiled on sm_90 alone
(`aot.TIMED_TARGET`). ~270 compiles on sm_90, ~145 on sm_80 and ~205 on sm_89 (its float32 ones
included), shared out among child processes, one per CPU core (PAGEDSERVE_AOT_JOBS overrides). float16
(the same code as bfloat16 but for the type), float32 on the other targets and the unthinned
set: `python benchmarks/kernels.py --static`.

Shared memory: a configuration must fit unless it is only ever a timed GEMM candidate
(not the first of `_candidates`): `triton/gemm.py`'s `timed_choice` skips candidates that fail
to launch, and the first candidate is what runs untimed. Those are reported as warnings.

The children run without TRITON_INTERPRET (set by conftest.py without CUDA; see
kernels/triton/aot.py); the results are shared by the tests here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import triton  # noqa: F401 - a hard requirement here: this test is the GPU-less check

from pagedserve.kernels.triton import aot

TARGETS = list(aot.TARGETS)


FLOAT32_TARGET = "sm_89"
"""float32 activations' configurations (attention and cache write only) are compiled for the target
with the least shared memory per block: their dot runs on the FMA units (ieee precision) on every
target, so shared memory is what tells the targets apart (the others: `--static`)."""


@pytest.fixture(scope="module")
def results():
    return (aot.compile_all(TARGETS, dtypes=(torch.bfloat16,), reduced=True)
            + aot.compile_all([FLOAT32_TARGET], dtypes=(torch.float32,), reduced=True))


def _rows(results, target, bad):
    rows = [f"{r.kernel} [{r.config}]: {bad(cfg, r)} (e.g. {cfg.uses[0]})"
            for cfg, r in results if r.target == target and bad(cfg, r)]
    return "\n".join(rows)


@pytest.mark.parametrize("target", TARGETS)
def test_every_configuration_compiles(results, target):
    failed = _rows(results, target, lambda cfg, r: r.error if not r.ok else "")
    assert not failed, f"compile errors on {target}:\n{failed}"


@pytest.mark.parametrize("target", TARGETS)
def test_no_register_spills(results, target):
    spilled = _rows(results, target, lambda cfg, r: f"{r.spills} spilled words, {r.registers} registers"
                    if r.ok and r.spills else "")
    assert not spilled, f"register spills on {target}:\n{spilled}"


@pytest.mark.parametrize("target", TARGETS)
def test_shared_memory_fits(results, target):
    def over(cfg, r):
        return f"{r.shared} B > {r.smem_limit} B" if r.ok and not r.smem_ok else ""

    too_big = _rows(results, target, lambda cfg, r: over(cfg, r) if not cfg.timed_only else "")
    assert not too_big, f"shared memory beyond the {target} limit:\n{too_big}"
    skipped = _rows(results, target, lambda cfg, r: over(cfg, r) if cfg.timed_only else "")
    if skipped:
        warnings.warn(f"timed GEMM candidates that cannot launch on {target} (timed_choice skips them):\n{skipped}")


def test_enumeration_follows_the_launchers(results):
    """The recorded configurations show the launchers' choices per target: fp8 KV decoded in
    software only before sm_89, FP8 activations (per-token quant, fp8 x fp8 dot) only from
    sm_89 (and from there the fp8 weight against 16-bit activations at decode sizes, converted
    by the hardware), split-KV and split-K both taken and not, the sliding window and the whole
    context, soft-capped scores at head dim 256 (Gemma 2), attention sinks (gpt-oss), every model's
    head group, the MoE kernels' two row tiles, fp8 experts (decoded in software before sm_89, per
    channel and block-wise), int8, 4-bit and MXFP4 experts and biased ones with the clamped
    SwiGLU, block-wise FP8 and int8 weights, the INT4 weight dequantized for prompt-sized M,
    `deterministic`'s GEMM at both its column tiles and its norm in every rounding order."""
    by_target = {t: [cfg for cfg, r in results if r.target == t] for t in TARGETS}

    def values(target, kernel, name):
        return {dict(cfg.key[1])[name] for cfg in by_target[target] if cfg.kernel == kernel}

    assert values("sm_80", "_paged_attention_kernel", "KV_FP8") == {0, 2}
    assert values("sm_89", "_paged_attention_kernel", "KV_FP8") == {0, 1}
    assert values("sm_90", "_paged_attention_kernel", "KV_FP8") == {0, 1}
    assert values("sm_80", "_fp8_gemm_kernel", "A_FP8") == {False}
    assert values("sm_80", "_fp8_gemm_kernel", "NATIVE_FP8") == {False}
    # from sm_89 FP8 activations, and for decode-sized M also the weight against 16-bit ones
    assert values("sm_90", "_fp8_gemm_kernel", "A_FP8") == {True, False}
    assert values("sm_90", "_fp8_gemm_kernel", "NATIVE_FP8") == {True, False}
    assert not any(cfg.kernel == "_per_token_quant_kernel" for cfg in by_target["sm_80"])
    for t in TARGETS:
        assert values(t, "_paged_attention_kernel", "GROUP") == {2, 3, 4, 8}
        assert values(t, "_paged_attention_kernel", "SINKS") == {False, True}
        assert values(t, "_moe_down_kernel", "HAS_BIAS") == {False, True}
        gate_up = [dict(cfg.key[1]) for cfg in by_target[t] if cfg.kernel == "_moe_gate_up_kernel"]
        # the biased form bounds the plain one; gpt-oss ships no block-wise fp8 or int8: those have no biased twin
        assert all(p["CLAMPED_SWIGLU"] for p in gate_up if not p["GROUPED"] and p["W_FP8"] != 3)
        assert values(t, "_moe_gate_up_kernel", "W_INT4") == values(t, "_moe_down_kernel", "GROUPED") == {False, True}
        assert values(t, "_fp8_gemm_kernel", "GROUP_K") >= {128}  # (and 0 where a timed K tile of 256 has no twin)
        assert values(t, "_fp8_gemm_kernel", "INT_CODES") == {False, True}
        assert len(values(t, "_paged_attention_kernel", "NUM_SPLITS")) >= 2
        assert values(t, "_paged_attention_kernel", "SLIDING") == {False, True}
        assert values(t, "_paged_attention_kernel", "SOFTCAP") == {False, True}
        assert values(t, "_paged_attention_kernel", "HEAD_DIM") == {64, 128, 256}
        assert values(t, "_w4a16_kernel", "SPLIT") == {False, True}
        assert {cfg.kernel for cfg in by_target[t]} >= {
            "_write_kv_kernel", "_paged_attention_kernel", "_split_reduce_kernel", "_w4a16_kernel",
            "_splitk_reduce_kernel", "_fp8_gemm_kernel", "_dequant_kernel", "_moe_gate_up_kernel", "_moe_down_kernel",
            "_lora_shrink_kernel", "_lora_expand_kernel", "_matmul_kernel", "_rms_norm_kernel", "_log_softmax_kernel",
            "_w4a16_gemv_kernel", "_w8a16_gemv_kernel"}
        assert values(t, "_matmul_kernel", "BLOCK_N") == {32, 64}  # deterministic: by the weight's rows and the SMs
        assert values(t, "_rms_norm_kernel", "ORDER") == {0, 1, 2}
        assert values(t, "_moe_gate_up_kernel", "BLOCK_M") == ({16, 32, 64, 128} if t == "sm_90" else {16, 64})  # timed
        assert values(t, "_lora_shrink_kernel", "BLOCK_M") == {16, 64}
        assert values(t, "_lora_shrink_kernel", "BLOCK_R") == values(t, "_lora_expand_kernel", "BLOCK_K") == {16, 32, 64}
        assert values(t, "_moe_down_kernel", "W_FP8") == ({0, 2, 3, 4} if t == "sm_80" else {0, 1, 3, 4})  # int8, mxfp4


def test_fp8_kv_software_decode_matches_hardware(monkeypatch):
    """The e4m3 decode sm_80 compiles (KV_FP8=2) gives the same attention output as the
    hardware conversion (KV_FP8=1): both are exact. Runs wherever the other kernel tests
    run (interpreter on CPU, compiled on CUDA)."""
    from pagedserve.kernels.triton import paged_attention as pa

    if not torch.cuda.is_available() and not pa._interpreting():
        pytest.fail("kernels imported without TRITON_INTERPRET=1 and no CUDA")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    q_lens, seq_lens = [1, 1, 5], [40, 17, 29]
    cache = (torch.randn(2, 12, block_size, kv_heads, head_dim, generator=gen) * 3).to(torch.float8_e4m3fn)
    query = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(12, generator=gen)[:9].view(3, 3).to(torch.int32)
    starts = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    args = [t.to(device) for t in (query, cache[0], cache[1], tables, torch.tensor(seq_lens, dtype=torch.int32),
                                   starts)]
    outs = []
    for native in (True, False):
        monkeypatch.setattr(pa, "native_fp8", lambda dev, native=native: native)
        outs.append(pa.paged_attention_triton(*args, 0.2, k_scale=0.5, v_scale=0.25))
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])


def test_fp8_gemm_mode_follows_capability(monkeypatch):
    """Without e4m3 hardware the FP8 GEMM defaults to W8A16 whatever PAGEDSERVE_FP8_MODE
    says, and refuses an explicit mode="fp8" (it would not compile)."""
    from pagedserve.kernels.triton import fp8 as ft
    from pagedserve.kernels.fp8 import quantize_fp8

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(ft, "native_fp8", lambda device: False)
    monkeypatch.setenv("PAGEDSERVE_FP8_MODE", "fp8")
    assert ft.default_mode(device) == "w8a16"
    w = quantize_fp8(torch.randn(16, 32)).to(device)
    with pytest.raises(ValueError, match="8.9"):
        ft.fp8_matmul_triton(torch.randn(2, 32, device=device).to(torch.bfloat16), w, mode="fp8")


def test_static_report(results, request):
    """The report `make test` prints (tests/kernels/static_report.py): every configuration's registers,
    spills and shared memory per target, written in full to the pytest cache, and the programs one
    decode token's quantized GEMMs launch on each target (Llama-3-8B, M = 1) against its SMs. Every
    committed choice (kernels/triton/configs/) is among the compiled configurations; the spill test
    above fails on any of them."""
    from . import static_report

    committed = [cfg for cfg, r in results if any(u.startswith("committed ") for u in cfg.uses)]
    programs = [row for t in TARGETS for row in aot.decode_programs(aot.TARGETS[t])]
    assert {row["layer"] for row in programs} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert all(count > 0 or name in ("cuBLAS", "torch._scaled_mm") for row in programs for name, count in row["launches"])
    table = aot.programs_table(programs)
    lines = [f"{cfg.kernel} [{r.config}] {r.target}: {r.cell} (e.g. {cfg.uses[0]})" for cfg, r in results]
    folder = request.config.cache.mkdir("static_report")
    path = folder / "static_report.md"
    path.write_text("\n".join(["# Static kernel report", "", *aot.resource_lines(results), "",
                               "## Programs at M = 1", "", *table, "", "## Every configuration", "", *lines, ""]))
    static_report.LINES[:] = aot.resource_lines(results) + [f"{len(committed)} committed choices compiled", *table]
    static_report.PATH[:] = [str(path)]


def test_committed_choices_are_compiled_for_their_target(tmp_path, monkeypatch):
    """A choice committed for a GPU (kernels/triton/tuned.py's file, its `capability`) is replayed as
    its launcher would launch it, and enumerated with the target's own configurations (so the
    spill and shared-memory checks cover it), on that target only."""
    import json

    from pagedserve.kernels.triton import tuned
    from pagedserve.kernels.triton.gemm import GemmConfig

    key = ("w4a16", torch.device("cuda"), 1, 4096, 4096, 128, torch.bfloat16, False)
    choice = tuned.entry(key, GemmConfig(16, 32, 128, 4, 5, split_k=3))
    (tmp_path / "Some_GPU.json").write_text(json.dumps({"device": "Some GPU", "capability": "sm_90", "choices": [choice]}))
    monkeypatch.setenv(tuned.CONFIG_DIR_ENV, str(tmp_path))
    small = [m for m in aot.MODELS if m.name == "SmolLM2-135M"]

    def committed(target):
        return [cfg for cfg in aot.enumerate_configs(aot.TARGETS[target], (torch.bfloat16,), small)
                if any(u.startswith("committed Some_GPU.json kernel=w4a16|m=1|n=4096") for u in cfg.uses)]

    found = committed("sm_90")
    assert {cfg.kernel for cfg in found} == {"_w4a16_kernel", "_splitk_reduce_kernel"}
    w4a16 = next(dict(cfg.key[1]) for cfg in found if cfg.kernel == "_w4a16_kernel")
    assert (w4a16["BLOCK_N"], w4a16["BLOCK_K"], w4a16["SPLIT"]) == (32, 128, True)
    assert committed("sm_80") == []
    rows = aot.decode_programs(aot.TARGETS["sm_90"])
    o_proj = next(r for r in rows if r["layer"] == "o_proj" and r["kind"].startswith("int4"))
    assert o_proj["committed"] and o_proj["launches"] == [("_w4a16_kernel", 128 * 3), ("_splitk_reduce_kernel", 4)]
