"""The decoder layers in one C call (backend/cpu/decoder_stack.py over kernels/cpu/decoder_stack.py) against the same layers
run one kernel at a time from Python: the same logits to the bit and the same greedy tokens,
over plain batches, chunked prefill mixed with decodes, and preemption; also in the AVX2 code
an AVX2-only CPU runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.cpu.linear_methods import few_rows_of
from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu, decoder_stack as decoder_stack_cpu

from ..conftest import assert_engine_idle
from ..kernels.instruction_sets import build_every_kernel_for, runs_avx2

pytestmark = pytest.mark.skipif(decoder_stack_cpu.kernels() is None,
                                reason="the C decoder stack needs a C compiler and a CPU with AVX2 or AVX-512")
bf16_pairs = pytest.mark.skipif(not bf16_matmul_cpu.native(),
                                reason="bf16 engines multiply weights in pairs only with AVX512-BF16 (and, with AMX, a kernel built for its tiles)")


@pytest.fixture(scope="module")
def bf16_engine() -> LLMEngine:
    """The bundled model in bf16 with a small token budget, so prompts are prefilled in chunks
    beside other sequences' decodes."""
    return LLMEngine(dtype="bfloat16", max_num_batched_tokens=96, max_num_seqs=8, num_kv_blocks=512,
                     enable_prefix_caching=False)


class StackCalls:
    """Counts the steps the C stack ran (a decline, None, is not counted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.count = 0
        run = decoder_stack_cpu.DecoderStack.run

        def counted(stack, *args, **kwargs):
            out = run(stack, *args, **kwargs)
            self.count += out is not None
            return out

        monkeypatch.setattr(decoder_stack_cpu.DecoderStack, "run", counted)


def greedy(engine: LLMEngine, prompts: list[list[int]], c_stack: bool, max_tokens: int = 20) -> list[list[int]]:
    engine.runner.model.fused_layers.enabled = c_stack
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [r.token_ids for r in engine.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.runner.model.fused_layers.enabled = True


@bf16_pairs
def test_chunked_prefill_beside_decodes_gives_the_python_layers_tokens(bf16_engine, prompts, monkeypatch):
    calls = StackCalls(monkeypatch)
    in_python = greedy(bf16_engine, prompts, c_stack=False)
    assert calls.count == 0
    in_c = greedy(bf16_engine, prompts, c_stack=True)
    assert in_c == in_python
    assert calls.count > 0, "the C stack never ran"
    assert_engine_idle(bf16_engine)


@bf16_pairs
def test_whole_prompt_logits_equal_the_python_layers_to_the_bit(bf16_engine, prompts):
    runner = bf16_engine.runner
    prompt = prompts[-1]  # ~400 tokens over several blocks
    blocks = list(range(10, 10 + -(-len(prompt) // runner.block_size)))
    runner.model.fused_layers.enabled = False
    expected = runner.run_prefill(prompt, blocks)
    runner.model.fused_layers.enabled = True
    assert torch.equal(runner.run_prefill(prompt, blocks), expected)


@bf16_pairs
def test_preemption_under_a_tiny_kv_cache_gives_the_python_layers_tokens(prompts, monkeypatch):
    engine = LLMEngine(dtype="bfloat16", num_kv_blocks=28, enable_prefix_caching=False)  # 448 slots, ~830 tokens of work
    calls = StackCalls(monkeypatch)
    longest_first = prompts[::-1]
    in_c = greedy(engine, longest_first, c_stack=True, max_tokens=24)
    assert engine.stats().num_preemptions > 0
    assert calls.count > 0
    assert in_c == greedy(engine, longest_first, c_stack=False, max_tokens=24)
    assert_engine_idle(engine)


@bf16_pairs
def test_one_sequence_whose_linears_read_the_checkpoint_blocks_gives_the_python_layers_tokens(bf16_engine, prompts,
                                                                                               monkeypatch):
    first = bf16_engine.runner.model.layers[0].self_attn.qkv_proj
    if few_rows_of(first.method) == 0:
        pytest.skip("no checkpoint blocks kept for a few rows (AMX tiles are ahead of them from one row)")
    calls = StackCalls(monkeypatch)
    for prompt in prompts[:3]:  # its decodes are one row: the GGUF blocks in float32, as Linear.forward multiplies them
        assert greedy(bf16_engine, [prompt], c_stack=True, max_tokens=12) == greedy(bf16_engine, [prompt], c_stack=False,
                                                                                     max_tokens=12)
    assert calls.count >= 3 * 11


def test_an_fp8_kv_cache_runs_the_layers_in_python(prompts, monkeypatch):
    engine = LLMEngine(dtype="bfloat16", kv_cache_dtype="fp8", max_num_seqs=4, num_kv_blocks=128,
                       enable_prefix_caching=False)
    calls = StackCalls(monkeypatch)
    greedy(engine, prompts[:2], c_stack=True, max_tokens=4)
    assert calls.count == 0
    assert engine.runner.model.fused_layers.stack(engine.runner.kv_caches) is None


@bf16_pairs
def test_a_kernel_declining_mid_step_falls_back_to_the_python_layers(bf16_engine, prompts, monkeypatch):
    """A decode kernel that declines (beyond its buffers: -1) after the first layer's cache write:
    the step reruns in Python (the rows written so far are written again with the same values)."""
    import ctypes

    expected = greedy(bf16_engine, prompts[:4], c_stack=False, max_tokens=8)
    model = bf16_engine.runner.model
    stack = model.fused_layers.stack(bf16_engine.runner.kv_caches)
    declining = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: -1)  # the C side passes arguments it ignores
    monkeypatch.setattr(stack.kernels, "decode", ctypes.cast(declining, ctypes.c_void_p).value)
    calls = StackCalls(monkeypatch)
    assert greedy(bf16_engine, prompts[:4], c_stack=True, max_tokens=8) == expected
    assert calls.count > 0  # the prefill-only steps still ran in C
    assert_engine_idle(bf16_engine)


def test_float32_steps_on_the_checkpoint_blocks_give_the_python_layers_tokens(engine, prompts, monkeypatch):
    """The float32 engine (the suite's shared one): every linear multiplies the GGUF blocks."""
    if engine.runner.model.fused_layers.stack(engine.runner.kv_caches) is None:
        pytest.skip("this float32 engine's linears are not all GGUF blocks (no C compiler, or another layout)")
    calls = StackCalls(monkeypatch)
    in_c = greedy(engine, prompts, c_stack=True, max_tokens=12)
    assert calls.count > 0
    assert in_c == greedy(engine, prompts, c_stack=False, max_tokens=12)
    assert_engine_idle(engine)


def test_a_sliding_window_on_every_layer_gives_the_python_layers_tokens(engine, prompts, monkeypatch):
    """Mistral's window on every layer: the C loop reads the step's windowed plan (decodes through
    tables of the window's slots), with the Python layers' tokens; the window changes them. The
    float32 engine is told its layers have a window of 48 (the prefix cache is emptied around it:
    the window changes every later layer's keys)."""
    model = engine.runner.model
    if model.fused_layers.stack(engine.runner.kv_caches) is None:
        pytest.skip("this float32 engine's linears are not all GGUF blocks (no C compiler, or another layout)")
    whole_context = greedy(engine, prompts[:4], c_stack=True, max_tokens=12)
    window = 48
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, sliding_window=window,
                                                             sliding_layers=tuple(range(model.config.num_layers))))
    for layer in model.decoder_layers:
        monkeypatch.setattr(layer.self_attn, "window", window)
    engine.block_manager.reset_prefix_cache()
    try:
        calls = StackCalls(monkeypatch)
        in_c = greedy(engine, prompts[:4], c_stack=True, max_tokens=12)
        assert calls.count > 0
        engine.block_manager.reset_prefix_cache()
        assert in_c == greedy(engine, prompts[:4], c_stack=False, max_tokens=12)
        assert in_c != whole_context
    finally:
        engine.block_manager.reset_prefix_cache()
    assert_engine_idle(engine)


@pytest.mark.parametrize("variation", [dict(qk_norm=True), dict(qk_norm=True, qk_norm_across_heads=True),
                                       dict(sublayer_output_norms=True), dict(norm_rounds_once=True),
                                       dict(residual_multiplier=0.5)])
def test_layers_the_c_loop_has_no_code_for_run_in_python(engine, variation):
    """Qwen3's and OLMo 2's query / key norms, OLMo 2's norms after the sublayers and its rounding,
    Granite's residual multiplier: the C loop declines each (the float32 engine's layers, which it
    takes, told they are of such a model)."""
    model = engine.runner.model
    if model.fused_layers.stack(engine.runner.kv_caches) is None:
        pytest.skip("this float32 engine's linears are not all GGUF blocks (no C compiler, or another layout)")
    config = model.config
    try:
        model.config = dataclasses.replace(config, **variation)
        model.fused_layers._built = None
        assert model.fused_layers.stack(engine.runner.kv_caches) is None
    finally:
        model.config, model.fused_layers._built = config, None
    assert model.fused_layers.stack(engine.runner.kv_caches) is not None


def test_avx2_code_gives_the_python_layers_tokens(prompts, monkeypatch):
    """Every kernel in the AVX2 code an AVX2-only CPU runs (float32, the GGUF blocks): every
    step, prompts included, in the C loop, with the Python layers' tokens."""
    if not runs_avx2():
        pytest.skip("this CPU does not run AVX2 code")
    build_every_kernel_for(monkeypatch, "haswell")
    engine = LLMEngine(dtype="float32", max_num_seqs=4, num_kv_blocks=256, enable_prefix_caching=False)
    if engine.runner.model.fused_layers.stack(engine.runner.kv_caches) is None:
        pytest.skip("this float32 engine's linears are not all GGUF blocks (another layout)")
    calls = StackCalls(monkeypatch)
    in_c = greedy(engine, prompts[:4], c_stack=True, max_tokens=12)
    assert calls.count >= 12  # the prompts' steps and the decodes'
    assert in_c == greedy(engine, prompts[:4], c_stack=False, max_tokens=12)
    assert_engine_idle(engine)


def test_the_last_layer_runs_for_the_sampled_rows_alone_with_the_same_logits(prompts, monkeypatch):
    """A step's logits come from its sampled rows (a prompt's last token, each decode): the last
    layer past its attention runs for those rows alone, in C as in Python to the bit, with the
    logits of running every row and picking them (a few rows are summed in another order: the
    few-row loop) and their greedy tokens; no sampled row, no logits."""
    from pagedserve.backend.sampling_params import SamplingParams
    from pagedserve.backend.scheduler import ScheduledBatch
    from pagedserve.backend.sequence import Sequence

    # an engine of its own: the step below writes KV blocks no block manager handed out
    engine = LLMEngine(dtype="float32", max_num_seqs=4, num_kv_blocks=256, enable_prefix_caching=False)
    runner, model = engine.runner, engine.runner.model
    if model.fused_layers.stack(runner.kv_caches) is None:
        pytest.skip("this float32 engine's linears are not all GGUF blocks (no C compiler, or another layout)")
    batch, first_block = ScheduledBatch(), 10
    for i, prompt in enumerate(prompts[3:6]):
        seq = Sequence(f"rows-{i}", list(prompt), SamplingParams())
        blocks = -(-len(prompt) // runner.block_size)
        seq.block_table, first_block = list(range(first_block, first_block + blocks)), first_block + blocks
        batch.add(seq, len(prompt))
    inputs = runner.prepare(batch)
    sampled = inputs.logits_indices
    assert 1 < len(sampled) < len(inputs.input_ids)
    model.fused_layers.enabled = False
    inputs.logits_indices = torch.arange(len(inputs.input_ids))
    every_row = runner.run(inputs)[sampled]
    inputs.logits_indices = sampled
    in_python = runner.run(inputs)
    model.fused_layers.enabled = True
    calls = StackCalls(monkeypatch)
    assert torch.equal(runner.run(inputs), in_python)
    assert calls.count == 1
    torch.testing.assert_close(in_python, every_row, rtol=1e-4, atol=1e-4)
    assert torch.equal(in_python.argmax(-1), every_row.argmax(-1))
    inputs.logits_indices = sampled[:0]
    for c_stack in (True, False):
        model.fused_layers.enabled = c_stack
        assert runner.run(inputs).shape == (0, every_row.shape[1])
