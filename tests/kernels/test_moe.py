"""The mixture-of-experts MLP: the torch reference (kernels/moe.py) against transformers' own
experts and routers, to the bit (gpt-oss's within rounding); the fused Triton kernel (kernels/triton/moe.py) against the
reference on random routings (interpreter on CPU, compiled on CUDA).

Bounds for the Triton kernel, max |out - ref| / max |ref|: bfloat16 2e-2, float16 5e-3 (the kernel
forms silu(gate) * up from float32 accumulators and sums a token's k slots in float32; the
reference rounds gate, up and each expert's product to the model dtype, as transformers does).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.fp8 import fp8_from_blocks, quantize_fp8_blocks
from pagedserve.kernels.int4 import dequantize_int4, quantize_int4
from pagedserve.kernels.moe import (ExpertWeights, fused_moe_ref, quantize_experts_fp8, quantize_experts_int4, route,
                                    stack_experts)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0,
            device: torch.device = DEVICE) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    return ExpertWeights(w13.to(device=device, dtype=dtype), w2.to(device=device, dtype=dtype))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_transformers_sparse_moe_block_to_the_bit(family, dtype):
    """Routing (softmax, top-k, renormalised or not, weights rounded or not) and the experts' sum in
    transformers' order: the same bits as its MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=8,
                                                    num_experts_per_tok=2))
        k, renormalize, rounded = 2, True, False
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8,
                                                      num_experts_per_tok=3, norm_topk_prob=False))
        k, renormalize, rounded = 3, False, True
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    block = block.to(dtype).eval()
    x = torch.randn(1, 37, 64, dtype=dtype)
    with torch.inference_mode():
        expected = block(x)[0]
        weights, ids = route(torch.nn.functional.linear(x[0], block.gate.weight), k, renormalize, rounded)
        ours = fused_moe_ref(x[0], ExpertWeights(block.experts.gate_up_proj, block.experts.down_proj), weights, ids)
    assert torch.equal(ours, expected)


GPT_OSS_SWIGLU = (1.702, 7.0)


def gpt_oss_experts(block) -> ExpertWeights:
    """transformers' GptOssExperts as our layout: [E, H, 2I] with gate / up interleaved in its
    columns -> w13 [E, 2I, H] gate rows then up rows; down [E, I, H] -> w2 [E, H, I]."""
    e = block.experts
    w13 = torch.cat((e.gate_up_proj[..., ::2], e.gate_up_proj[..., 1::2]), dim=-1).transpose(1, 2)
    b13 = torch.cat((e.gate_up_proj_bias[..., ::2], e.gate_up_proj_bias[..., 1::2]), dim=-1)
    return ExpertWeights(w13.contiguous(), e.down_proj.transpose(1, 2).contiguous(), w13_bias=b13,
                         w2_bias=e.down_proj_bias, clamped_swiglu=(e.alpha, e.limit))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_transformers_gpt_oss_mlp(dtype):
    """gpt-oss's router (a bias; softmax of the top 4 logits) and biased experts with the clamped
    SwiGLU (gate capped at 7, up within +-7: scaled weights drive some values past the limit):
    transformers' GptOssMLP within rounding (it multiplies x by [H, 2I] tensors, we by [2I, H])."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    block = GptOssMLP(GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=4))
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    block = block.to(dtype).eval()
    x = torch.randn(1, 37, 64, dtype=dtype)
    with torch.inference_mode():
        expected = block(x)[0][0]
        logits = torch.nn.functional.linear(x[0], block.router.weight, block.router.bias)
        weights, ids = route(logits, 4, renormalize=False, rounded=False, softmax_after_topk=True)
        ours = fused_moe_ref(x[0], gpt_oss_experts(block), weights, ids)
        gate_up = x[0] @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7).float().mean() > 0.05  # the clamps matter
    assert _rel_err(ours, expected) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_reference_of_no_tokens_is_empty():
    x = torch.zeros(0, 32)
    out = fused_moe_ref(x, experts(4, 32, 16, torch.float32, device=torch.device("cpu")), torch.zeros(0, 2),
                        torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 32)


triton_moe = pytest.importorskip("pagedserve.kernels.triton.moe") if CUDA or __import__("os").environ.get(
    "TRITON_INTERPRET") == "1" else None


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _routing(tokens: int, num_experts: int, k: int, seed: int, skewed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random router logits' top-k (skewed: most tokens prefer the first experts, some experts get none)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    if skewed:
        logits[:, : num_experts // 2] += 4.0
    weights, ids = route(logits, k, renormalize=True, rounded=False)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,num_experts,k,hidden,inter,skewed", [
    (1, 8, 2, 64, 96, False),  # one decode
    (5, 8, 2, 128, 64, False),
    (70, 16, 4, 64, 80, True),  # hidden and inter not multiples of the tiles; idle experts
])
def test_triton_kernel_matches_the_reference(dtype, tokens, num_experts, k, hidden, inter, skewed):
    layer = experts(num_experts, hidden, inter, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    weights, ids = _routing(tokens, num_experts, k, seed=tokens, skewed=skewed)
    ref = fused_moe_ref(x, layer, weights, ids)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < TOL[dtype]


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [1, 70])
def test_triton_kernel_with_biased_experts_and_the_clamped_swiglu(tokens):
    """gpt-oss's experts (biases on both projections, the clamped SwiGLU, values past its limit)."""
    layer = experts(16, 64, 80, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    layer.w13 = layer.w13 * 4  # gate / up of std ~4: the clamps at 7 cut some
    layer.w13_bias = (torch.randn(16, 160, generator=g) * 0.5).to(DEVICE, torch.bfloat16)
    layer.w2_bias = (torch.randn(16, 64, generator=g) * 0.5).to(DEVICE, torch.bfloat16)
    layer.clamped_swiglu = GPT_OSS_SWIGLU
    x = torch.randn(tokens, 64, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = _routing(tokens, 16, 4, seed=tokens)
    ref = fused_moe_ref(x, layer, weights, ids)
    # activations of 10-50 and outputs of ~10 round to bf16 in steps of 1/16-1/4 at each bias add and
    # (the reference) at each of the SwiGLU's steps: 3e-2 here (measured 2.3e-2; both the kernel and
    # the reference are ~2e-2 from the float32 result of the same weights)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < 3e-2


def test_fp8_experts_stay_near_the_model_dtype_ones():
    """e4m3 experts with per-channel scales (3 mantissa bits): the reference's output within 6% of
    the bf16 experts' (measured ~3%), and the stored weights are one byte each."""
    layer = experts(8, 64, 96, torch.bfloat16, device=torch.device("cpu"))
    fp8 = quantize_experts_fp8(layer)
    assert fp8.w13.element_size() == 1 and fp8.w13_scale is not None and fp8.w13_scale.shape == (8, 192)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(40, 8), 2, renormalize=True, rounded=False)
    assert _rel_err(fused_moe_ref(x, fp8, weights, ids), fused_moe_ref(x, layer, weights, ids)) < 0.06


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("native", [True, False], ids=["e4m3-hardware", "e4m3-decoded"])
def test_triton_kernel_with_fp8_experts_matches_the_reference(native, monkeypatch):
    """The e4m3 experts converted by the hardware (sm_89+) and decoded with integer ops (A100):
    the fp8 reference's result within the bf16 bound."""
    if native and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no e4m3 conversion (the decoded variant is what it runs)")
    monkeypatch.setattr(triton_moe, "native_fp8", lambda device: native)
    layer = quantize_experts_fp8(experts(16, 64, 80, torch.bfloat16, seed=2))
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    weights, ids = _routing(70, 16, 4, seed=5, skewed=True)
    ref = fused_moe_ref(x, layer, weights, ids)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < TOL[torch.bfloat16]


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_gives_every_pair_one_row_of_its_expert(block_m):
    """Each (token, slot) pair sits once in the sorted rows, in a block of its own expert; the other
    rows are padding; blocks past the last expert's are marked -1."""
    _, ids = _routing(50, 8, 2, seed=3, skewed=True)
    pairs, blocks = triton_moe.align_by_expert(ids, 8, block_m)
    flat = ids.reshape(-1).cpu()
    pairs, blocks = pairs.cpu().long(), blocks.cpu().long()
    real = pairs[pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    owner = blocks.repeat_interleave(block_m)
    assert torch.equal(owner[pairs < flat.numel()], flat[real])
    assert (blocks[blocks >= 0].diff() >= 0).all() and (blocks[(blocks >= 0).sum():] == -1).all()


def block_fp8_experts(layer: ExpertWeights, block: tuple[int, int] = (32, 32)) -> ExpertWeights:
    """`layer`'s experts as a block-wise FP8 checkpoint holds them, read back (group scales)."""
    def each(stacked):
        return [fp8_from_blocks(*quantize_fp8_blocks(w.float().cpu(), block), block).to(DEVICE) for w in stacked]
    return stack_experts(each(layer.w13), each(layer.w2))


def test_int4_experts_stay_near_the_model_dtype_ones():
    """4-bit experts (one group for both projections, dividing both widths): the reference's output
    within 15% of the bf16 experts' in norm (groups of 16 of Gaussian weights: a step of ~0.23
    standard deviations; measured 10-12% over seeds; a wrong scale or offset is ~100%), each
    expert's slice the Int4Weight the quantizer made, at a quarter of the bytes."""
    torch.manual_seed(0)
    layer = experts(8, 64, 48, torch.bfloat16, device=torch.device("cpu"))
    int4 = quantize_experts_int4(layer)
    assert int4.form == "int4" and int4.group_size == 16 and (int4.hidden, int4.inter) == (64, 48)
    assert int4.w13.shape == (8, 64 // 8, 96) and int4.w2_offset is not None and int4.w2_offset.shape == (8, 3, 64)
    again = quantize_int4(layer.w2[5], 16)
    assert torch.equal(dequantize_int4(int4.projection("w2", 5)), dequantize_int4(again))
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(40, 8), 2, renormalize=True, rounded=False)
    ours, exact = fused_moe_ref(x, int4, weights, ids).float(), fused_moe_ref(x, layer, weights, ids).float()
    assert ((ours - exact).norm() / exact.norm()).item() < 0.15


def test_experts_are_stacked_from_one_form_only():
    """A checkpoint's experts stack into one form; 4-bit groups of different sizes (per-channel
    checkpoints: one group a row, hidden wide for gate / up, inter for down) into their common
    divisor, exactly; mixed forms, act-order and fp8 scales of different groupings are refused by
    name."""
    w = torch.randn(32, 64)
    i4, f8 = quantize_int4(w, 32), quantize_experts_fp8(ExpertWeights(w[None], w[None, :, :32]))
    with pytest.raises(ValueError, match="mixed forms"):
        stack_experts([i4], [f8.projection("w2", 0)])
    per_channel = quantize_int4(w, 64)
    stacked = stack_experts([per_channel], [i4])
    assert stacked.group_size == 32 and torch.equal(dequantize_int4(stacked.projection("w13", 0)),
                                                    dequantize_int4(per_channel))
    with pytest.raises(ValueError, match="several group sizes"):
        stack_experts([f8.projection("w13", 0)], [fp8_from_blocks(*quantize_fp8_blocks(w, (32, 32)), (32, 32))])
    ordered = quantize_int4(w, 32)
    ordered.perm = torch.arange(64)
    with pytest.raises(ValueError, match="act-order"):
        stack_experts([ordered], [i4])


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,hidden,inter,group,skewed", [
    (1, 64, 96, 32, False),  # one decode; K tiles of 32 (the group)
    (70, 128, 64, 64, True),  # idle experts; groups of 64
    (9, 64, 48, 16, False),  # groups of 16: the smallest K tile
])
def test_triton_kernel_with_int4_experts_matches_the_reference(dtype, tokens, hidden, inter, group, skewed):
    """4-bit experts (codes, per-group scales and offsets) through the kernels' W4A16 path: the int4
    reference's result within the model dtype's bound."""
    dense = experts(16, hidden, inter, torch.float32, seed=tokens, device=torch.device("cpu"))
    layer = stack_experts([quantize_int4(w, group).to(DEVICE) for w in dense.w13],
                          [quantize_int4(w, group).to(DEVICE) for w in dense.w2])
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    weights, ids = _routing(tokens, 16, 4, seed=tokens, skewed=skewed)
    ref = fused_moe_ref(x, layer, weights, ids)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < TOL[dtype]


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [1, 70])
def test_triton_kernel_with_block_fp8_experts_matches_the_reference(tokens):
    """Block-wise e4m3 experts (32 x 32 blocks: the experts' widths 80 and 64 end in partial blocks):
    each K tile scaled by its group's scales; the fp8 reference's result within the bf16 bound."""
    layer = block_fp8_experts(experts(16, 64, 80, torch.float32, seed=2, device=torch.device("cpu")))
    assert layer.group_size == 32 and layer.w13_scale is not None and layer.w13_scale.shape == (16, 160, 2)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    weights, ids = _routing(tokens, 16, 4, seed=5, skewed=True)
    ref = fused_moe_ref(x, layer, weights, ids)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < TOL[torch.bfloat16]


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("group", [0, 32])
def test_triton_kernel_with_int8_experts_matches_the_reference(group):
    """int8 experts (W8A16 checkpoints) per channel and per group of 32: codes converted exactly,
    scales as the fp8 forms'; the int8 reference's result within the bf16 bound."""
    from pagedserve.kernels.fp8 import Int8Weight

    g = torch.Generator().manual_seed(6)

    def each(rows: int, cols: int) -> list[Int8Weight]:
        scales = (16, rows, -(-cols // group)) if group else (16, rows)
        codes = torch.randint(-127, 128, (16, rows, cols), generator=g, dtype=torch.int8)
        scale = torch.rand(scales, generator=g) * 2e-3 + 1e-3
        return [Int8Weight(codes[e].to(DEVICE), scale[e].to(DEVICE), group) for e in range(16)]

    layer = stack_experts(each(160, 64), each(64, 80))
    assert layer.form == "int8" and layer.group_size == group
    x = torch.randn(70, 64, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = _routing(70, 16, 4, seed=7, skewed=True)
    ref = fused_moe_ref(x, layer, weights, ids)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < TOL[torch.bfloat16]


def mxfp4_experts(num_experts: int, hidden: int, inter: int, seed: int) -> ExpertWeights:
    """Random MXFP4 experts (every code, scales 2^-7..2^-4) with gpt-oss's biases and activation."""
    g = torch.Generator().manual_seed(seed)

    def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, 256, (num_experts, rows, cols // 2), generator=g, dtype=torch.uint8).to(DEVICE),
                torch.randint(120, 124, (num_experts, rows, cols // 32), generator=g, dtype=torch.uint8).to(DEVICE))

    (w13, s13), (w2, s2) = codes(2 * inter, hidden), codes(hidden, inter)
    return ExpertWeights(w13, w2, s13, s2, (torch.randn(num_experts, 2 * inter, generator=g) * 0.1).to(DEVICE, torch.bfloat16),
                         (torch.randn(num_experts, hidden, generator=g) * 0.1).to(DEVICE, torch.bfloat16), GPT_OSS_SWIGLU,
                         group_size=32)


def test_mxfp4_experts_are_their_dequantized_weights():
    """The reference on MXFP4 experts (gpt-oss) is the reference on the same weights dequantized, to
    the bit in float32 (dequantizing is exact)."""
    from pagedserve.kernels.mxfp4 import dense

    layer = mxfp4_experts(8, 64, 96, seed=0)
    assert layer.form == "mxfp4" and (layer.hidden, layer.inter) == (64, 96)
    dense_layer = ExpertWeights(torch.stack([dense(layer.projection("w13", e)) for e in range(8)]),
                                torch.stack([dense(layer.projection("w2", e)) for e in range(8)]),
                                w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, clamped_swiglu=GPT_OSS_SWIGLU)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, ids = _routing(30, 8, 4, seed=2)
    assert torch.equal(fused_moe_ref(x, layer, weights, ids), fused_moe_ref(x, dense_layer, weights, ids))


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [1, 70])
def test_triton_kernel_with_mxfp4_experts_matches_the_reference(tokens):
    """gpt-oss's experts as shipped: e2m1 codes decoded in the kernel, each 32-input block's product
    scaled by its power of two, biases and the clamped SwiGLU; the reference within the bf16 bound."""
    layer = mxfp4_experts(16, 64, 96, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    weights, ids = _routing(tokens, 16, 4, seed=tokens, skewed=True)
    ref = fused_moe_ref(x, layer, weights, ids)
    assert _rel_err(triton_moe.fused_moe_triton(x, layer, weights, ids), ref) < 3e-2


@pytest.mark.skipif(triton_moe is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_experts", [16, 2], ids=["decode-sized", "prompt-sized"])
def test_every_tile_the_timing_tries_matches_the_reference(num_experts, monkeypatch):
    """What `timed_choice` may pick on a GPU, each candidate of both regimes (its K tiles cut to a
    4-bit group of 32), run here: the reference's result within the bf16 bound."""
    monkeypatch.setattr(triton_moe, "interpreting", lambda: False)
    candidates = triton_moe._candidates(70 * 2, num_experts, 32)
    monkeypatch.undo()
    assert len(candidates) == 4 and candidates[0].block_m == (16 if num_experts == 16 else 64)
    assert all(c.block_k == 32 for c in candidates)
    dense = experts(num_experts, 64, 96, torch.float32, seed=4, device=torch.device("cpu"))
    layer = stack_experts([quantize_int4(w, 32).to(DEVICE) for w in dense.w13], [quantize_int4(w, 32).to(DEVICE) for w in dense.w2])
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    weights, ids = _routing(70, num_experts, 2, seed=6)
    ref = fused_moe_ref(x, layer, weights, ids)
    for config in candidates:
        assert _rel_err(triton_moe._launch(x, layer, weights, ids, config), ref) < TOL[torch.bfloat16], config
