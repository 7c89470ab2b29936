"""The CPU linear methods (backend/cpu/linear_methods.py): each weight form multiplies to the
plain layer's product, packing releases what no method reads, and a layer's method is the one
thing it asks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.backend import LLMEngine
from pagedserve.backend.cpu.linear_methods import (
    Blocks,
    FewRowBlocks,
    OneDnnPacked,
    Pairs,
    Transposed,
    WeightLayouts,
    few_rows_of,
    keep_exact_blocks,
    pack,
    pack_weights,
)
from pagedserve.backend.model_config import ModelConfig
from pagedserve.backend.models.linear import Linear
from pagedserve.backend.models.llama import LlamaForCausalLM
from pagedserve.kernels.cpu import bf16_matmul as bf16_matmul_cpu, block_matmul as block_matmul_cpu
from pagedserve.kernels.cpu.block_matmul import grid_weight

from ..conftest import onednn_packs

TINY = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=64, tie_word_embeddings=True)
needs_blocks = pytest.mark.skipif(block_matmul_cpu.LIBRARY.get() is None, reason="needs the C block matmul (a C compiler)")


def test_the_bucketed_linear_gives_the_plain_linears_rows():
    """Padding rows to a bucket (oneDNN-packed bf16) changes no real row."""
    torch.manual_seed(0)
    layer = Linear(64, 96).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    pack(layer)
    for rows in (1, 5, 17, 100, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        out = layer(x)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, F.linear(x, weight, layer.bias), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype, float32_layout", [(torch.bfloat16, None), (torch.float16, None),
                                                    (torch.float32, "transposed"), (torch.float32, "onednn"),
                                                    (torch.float32, "both")])
def test_a_packed_linear_computes_what_the_plain_one_does(dtype, float32_layout):
    """oneDNN's packed weight (half precision, or float32 laid out "onednn"), the
    transposed float32 weight (MKL), and both (a few rows by the C GEMV over the plain
    weight, more by oneDNN) only reorder the weight or the sums: the same product."""
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(dtype)
    weight = layer.weight.detach().clone()
    packed = pack(layer, float32_layout or "transposed")
    method = layer.method
    assert isinstance(method, Transposed) == (float32_layout == "transposed")
    assert (isinstance(method, OneDnnPacked) and method.gemv_rows > 0) == (float32_layout == "both")
    # bf16 where the CPU has AVX512-BF16: packed in pairs for the C kernel, no oneDNN copy
    assert isinstance(method, Pairs) == (dtype == torch.bfloat16 and bf16_matmul_cpu.native())
    assert isinstance(method, OneDnnPacked) == (float32_layout != "transposed" and packed and not isinstance(method, Pairs))
    # oneDNN packs half precision only where the CPU has its instructions (avx512_bf16 /
    # avx512_fp16 or avx_ne_convert); such a layer stays unpacked and plain
    assert packed or dtype != torch.float32
    assert packed or method is None
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    for rows in (1, 3, 5, 17, 100, 300):
        x = torch.randn(rows, 64, dtype=dtype)
        expected = F.linear(x.float(), weight.float(), layer.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, **tolerance)


@needs_blocks
def test_a_half_precision_linear_multiplies_a_few_rows_by_its_exact_blocks(monkeypatch):
    """A bf16 layer given its checkpoint's Q4_1 blocks: up to a few rows (FEW_ROWS, fewer
    beside the C bf16 kernel) get the product with the exact weight (float32 sums, rounded
    once to bf16), more rows the product with the bf16-rounded weight (oneDNN or the C
    kernel); the bundled model's bf16 engine keeps the blocks of every linear, its tied LM
    head's too (from the embedding). Where the C kernel multiplies with AMX tiles, which beat
    the blocks from one row, no blocks are kept (the few-row path is checked as elsewhere)."""
    exact = grid_weight("q4_1", 96, 128, seed=3)
    layer = Linear(128, 96, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(exact)
    keep_exact_blocks(layer, exact)
    assert isinstance(layer.method, FewRowBlocks) and layer.method.then is None
    tiles = bf16_matmul_cpu.native() and bf16_matmul_cpu.instructions() == "AMX tiles"
    if tiles:  # AMX's tiles are ahead of the blocks from one row: pack drops them
        monkeypatch.setattr(bf16_matmul_cpu, "instructions", lambda: "AVX512-BF16")
    pack(layer)
    few = few_rows_of(layer.method)
    assert few > 0
    for rows in (1, 3, few, few + 1, 40):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        weight = exact if rows <= few else exact.to(torch.bfloat16).float()
        expected = F.linear(x.float(), weight).to(torch.bfloat16)
        torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-3)

    if tiles:
        monkeypatch.undo()
        layer.method = FewRowBlocks(layer.method.blocks)
        pack(layer)
        assert isinstance(layer.method, Pairs)

    engine = LLMEngine(dtype="bfloat16", num_kv_blocks=64)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * engine.model_config.num_layers + 1
    if tiles:
        assert all(isinstance(m.method, Pairs) for m in linears)
    else:
        assert all(isinstance(m.method, FewRowBlocks) for m in linears)
        assert engine.runner.model.lm_head.method.blocks.kind == "q8_0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_releases_the_plain_weights_but_keeps_a_tied_embedding(dtype):
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU (no avx512_bf16): they stay plain")
    model = LlamaForCausalLM(TINY, max_positions=64).to(dtype)
    assert pack_weights(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the lm_head
    assert model.layers[0].mlp.down_proj.weight.numel() == 0
    assert model.lm_head.weight is model.embed_tokens.weight and model.embed_tokens.weight.numel() == 256 * 64


def test_layers_laid_out_both_keep_the_plain_weight_their_single_rows_read():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    model = LlamaForCausalLM(TINY, max_positions=64)
    assert pack_weights(model, WeightLayouts(layers="both", lm_head="both")) == 2 * 4 + 1
    down = model.layers[0].mlp.down_proj
    assert isinstance(down.method, OneDnnPacked) and down.weight.shape == (64, 128)
    assert model.lm_head.weight is model.embed_tokens.weight and isinstance(model.lm_head.method, OneDnnPacked)


@needs_blocks
@pytest.mark.parametrize("float32_layout", ["transposed", "onednn", "both"])
def test_a_gguf_exact_layer_multiplies_its_blocks_at_every_row_count_and_keeps_no_float32_copy(float32_layout):
    """A GGUF Q4_1 checkpoint's layer, whatever the layout: every step reads the exact 4-bit
    parts (a sixth of the bytes), no float32 copy is kept, and the product is the plain layer's,
    for decode-sized and prefill-sized steps, 2-D or 3-D."""
    model = torch.nn.Sequential(Linear(128, 64, bias=True))
    with torch.no_grad():
        model[0].weight.copy_(grid_weight("q4_1", 64, 128, seed=3))
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    assert pack_weights(model, WeightLayouts(layers=float32_layout)) == 1
    layer = model[0]
    assert isinstance(layer.method, Blocks) and layer.weight.numel() == 0
    for shape in ((1, 128), (8, 128), (9, 128), (70, 128), (2, 5, 128)):
        x = torch.randn(shape)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 128, dtype=torch.float64)  # a dtype the C loops decline: the rebuilt weight
    torch.testing.assert_close(layer(x), F.linear(x, weight.double(), bias.double()))


def test_a_layer_without_a_method_is_nn_linear_and_packing_declines_what_no_form_fits():
    """No method: nn.Linear's product over the plain weight (CUDA, the compiled step); a weight
    no form applies to (float64) keeps none."""
    layer = Linear(32, 16).double()
    x = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.reads_plain_weight
    assert not pack(layer) and layer.method is None


@pytest.mark.bit_exact("cpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_batch_invariant_methods_give_a_row_the_same_bits_at_every_row_count(dtype):
    """`deterministic`'s methods: a row's outputs the same bits multiplied alone, beside a few rows or
    many, and at another place among them (a request's rows move as others join a step). The plain ones are not on every CPU: oneDNN multiplies a lone float32 / float16 row by
    another kernel than two or more (from 2,048 inputs), and with AMX its bf16 kernels change with
    the row count at many shapes; the batch-invariant bf16 method is the C pairs kernel."""
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weight on this CPU")
    g = torch.Generator().manual_seed(3)
    layer = Linear(2048, 512, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(512, 2048, generator=g) * 0.02)
        layer.bias.copy_(torch.randn(512, generator=g))
    assert pack(layer, "onednn", batch_invariant=True)
    if dtype == torch.bfloat16 and bf16_matmul_cpu.LIBRARY.get() is not None:
        assert isinstance(layer.method, Pairs)
    x = torch.randn(300, 2048, generator=g).to(dtype)
    with torch.inference_mode():
        every = layer(x)
        for start in (0, 5, 13):
            for rows in (1, 2, 7, 33, 48, 64, 129):
                assert torch.equal(layer(x[start:start + rows]), every[start:start + rows]), (start, rows)
