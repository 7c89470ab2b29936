"""Quantized checkpoints as shipped (AWQ, GPTQ and compressed-tensors 4-bit; FP8 per tensor, channel
or block from compressed-tensors, ModelOpt, AutoFP8 and DeepSeek-style releases) load into the
fused INT4 / FP8 layers and generate what transformers generates with the same weights in dense
form."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedserve.backend import LLMEngine
from pagedserve.kernels.fp8 import Fp8Weight, dequantize_fp8, fp8_from_blocks, quantize_fp8_blocks

from .conftest import GPU_SHARE, assert_greedy_matches_transformers
from .test_models import COMMON, build

pytestmark = pytest.mark.slow

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds column 8c + AWQ_ORDER[i]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] nibbles -> int32 words, nibble i at bits 4i."""
    shifted = nibbles.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    return torch.from_numpy(np.ascontiguousarray(np.bitwise_or.reduce(shifted, axis=-1)).view(np.int32))


def pack(fmt: str, codes: np.ndarray, zeros: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [K, N] and zeros [K/G, N] (0..15) in the checkpoint's packing."""
    k, n = codes.shape
    if fmt == "awq":  # both packed along N, interleaved
        order = list(AWQ_ORDER)
        return words(codes.reshape(k, n // 8, 8)[..., order]), words(zeros.reshape(-1, n // 8, 8)[..., order])
    # GPTQ v1: qweight sequential along K, qzeros sequential along N storing zero - 1
    qweight = words(codes.reshape(k // 8, 8, n).transpose(0, 2, 1))
    return qweight, words((zeros - 1).reshape(-1, n // 8, 8) & 15)


def compressed(codes: np.ndarray, zeros: np.ndarray | None) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized tensors of codes [K, N] (0..15) and zeros [K/G, N] (None:
    symmetric, zero 8): codes packed along K per output row, zeros along N."""
    k, n = codes.shape
    tensors = {"weight_packed": words(codes.T.reshape(n, k // 8, 8)), "weight_shape": torch.tensor([n, k])}
    if zeros is not None:
        tensors["weight_zero_point"] = words(zeros.T.reshape(n // 8, 8, -1).transpose(0, 2, 1))
    return tensors


INT4_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False},
    "compressed-int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}},
}
INT4_CONFIGS["compressed-int4-asym"] = json.loads(json.dumps(INT4_CONFIGS["compressed-int4"]))
INT4_CONFIGS["compressed-int4-asym"]["config_groups"]["group_0"]["weights"]["symmetric"] = False


def write_checkpoint(reference, quantized: dict[str, torch.Tensor], quantization: dict, directory, tokenizer,
                     config_file: str = "config.json") -> str:
    """`reference`'s tensors with its projections replaced by `quantized`, and `quantization` in its
    config.json (or, for ModelOpt, in hf_quant_config.json)."""
    reference.save_pretrained(directory / "dense")
    rest = {k: v for k, v in reference.state_dict().items() if not any(p in k for p in PROJECTIONS)}
    out = directory / "quantized"
    out.mkdir()
    save_file({**rest, **quantized}, out / "model.safetensors")
    config = json.loads((directory / "dense" / "config.json").read_text())
    if config_file == "config.json":
        config["quantization_config"] = quantization
    else:
        (out / config_file).write_text(json.dumps(quantization))
    (out / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(out)
    return str(out)


def llama_reference(kind: str = "llama"):
    """The random Llama (or another of test_models' kinds) whose projections a test replaces by
    quantized ones (and their dense values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind != "llama":
        return build(kind).eval()
    return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False)).eval()


def projections(reference):
    """(checkpoint name prefix, linear) of every decoder projection of `reference`."""
    for index, layer in enumerate(reference.model.layers):
        for name in PROJECTIONS:
            yield f"model.layers.{index}.{name}", layer.get_submodule(name)


def assert_serves_reference(directory: str, reference) -> LLMEngine:
    """The checkpoint's engine, having given `reference`'s greedy tokens."""
    engine = LLMEngine(model=directory, dtype="float32", **GPU_SHARE)
    prompts = [[1, 500, 42, 9000, 123], list(range(300, 340))]
    assert_greedy_matches_transformers(engine, reference, prompts, max_tokens=10)
    return engine


def int4_tensors(fmt: str, n: int, k: int, rng: np.random.Generator, group: int = GROUP) -> tuple[torch.Tensor, dict]:
    """A random 4-bit weight [N, K] as `fmt` stores it ({kind: tensor}) and its dense value."""
    codes = rng.integers(0, 16, (k, n))
    zeros = np.full((k // group, n), 8) if fmt == "compressed-int4" else rng.integers(1, 16, (k // group, n))
    scales = torch.from_numpy(rng.uniform(0.02, 0.08, (k // group, n))).half()
    dense = (torch.from_numpy(codes - np.repeat(zeros, group, axis=0)).float() * scales.float().repeat_interleave(group, 0))
    if fmt.startswith("compressed"):
        return dense.t(), compressed(codes, None if fmt == "compressed-int4" else zeros) | {"weight_scale": scales.t().contiguous()}
    qweight, qzeros = pack(fmt, codes, zeros)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    if fmt == "gptq":
        tensors["g_idx"] = torch.arange(k, dtype=torch.int32) // group
    return dense.t(), tensors


@pytest.mark.parametrize("fmt", list(INT4_CONFIGS))
def test_packed_checkpoint_matches_transformers_on_the_dense_weights(fmt, tmp_path, tokenizer):
    """AWQ, GPTQ and compressed-tensors W4A16 (symmetric, and with zero points): the packed codes,
    scales and zeros run as they are and generate transformers' tokens on the same weights dense."""
    rng = np.random.default_rng(0)
    reference = llama_reference()
    packed = {}
    for prefix, linear in projections(reference):
        dense, tensors = int4_tensors(fmt, *linear.weight.shape, rng)
        linear.weight.data.copy_(dense)
        packed |= {f"{prefix}.{kind}": tensor for kind, tensor in tensors.items()}
    directory = write_checkpoint(reference, packed, INT4_CONFIGS[fmt], tmp_path, tokenizer)

    engine = assert_serves_reference(directory, reference)
    assert type(engine.runner.model.layers[0].self_attn.qkv_proj).__name__ == "QuantizedLinear"


BLOCK = [24, 32]  # rows x columns: partial row blocks in k/v, two or four column groups
_FP8_CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"]}
FP8_CONFIGS = {  # name -> (scales: "channel", "tensor" or "block", quantization spec, the file it is in, scale name)
    "compressed-tensors": ("channel", _FP8_CT | {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, "input_activations": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}, "config.json", "weight_scale"),
    "compressed-tensors-block": ("block", _FP8_CT | {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": BLOCK},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True}}}},
        "config.json", "weight_scale"),
    "modelopt": ("tensor", {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": [
        "lm_head"]}}, "hf_quant_config.json", "weight_scale"),
    "block-fp8": ("block", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": BLOCK}, "config.json", "weight_scale_inv"),
    "autofp8": ("tensor", {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                "config.json", "weight_scale"),
}


def fp8_codes(weight: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of `weight` and their scale as the checkpoint stores it: one for the tensor, one per
    output channel [N, 1], or one per BLOCK tile."""
    if scales == "block":
        return quantize_fp8_blocks(weight, tuple(BLOCK))
    amax = weight.abs().amax(dim=1, keepdim=True) if scales == "channel" else weight.abs().amax().reshape(1)
    scale = amax / 448.0
    return (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()


def fp8_tensors(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, dict]:
    """`weight` as FP8 checkpoint format `fmt` stores it ({kind: tensor}) and the dense value of that."""
    scales, _, _, scale_name = FP8_CONFIGS[fmt]
    codes, scale = fp8_codes(weight.float(), scales)
    dense = codes.float() * scale if scales != "block" else dequantize_fp8(fp8_from_blocks(codes, scale, tuple(BLOCK)))
    return dense, {"weight": codes, scale_name: scale, "input_scale": torch.tensor([0.05])}


@pytest.mark.parametrize("fmt, kind", [(fmt, "llama") for fmt in FP8_CONFIGS] + [("block-fp8", "qwen3")])
def test_fp8_checkpoint_matches_transformers_on_the_dense_weights(fmt, kind, tmp_path, tokenizer):
    """llm-compressor's FP8 (per-channel scales with a static input scale; 24 x 32 blocks), ModelOpt's
    (per-tensor scales, hf_quant_config.json), block-wise FP8 as DeepSeek-V3 and Qwen3 ship it
    (weight_scale_inv per 24 x 32 block, partial blocks included) and AutoFP8's: the e4m3 weights
    run as they are (no bf16 copy) and generate transformers' tokens on the same weights dense."""
    scales, spec, config_file, _ = FP8_CONFIGS[fmt]
    reference = llama_reference(kind)
    quantized = {}
    for prefix, linear in projections(reference):
        dense, tensors = fp8_tensors(linear.weight.data, fmt)
        linear.weight.data.copy_(dense)
        quantized |= {f"{prefix}.{kind}": tensor for kind, tensor in tensors.items()}
    directory = write_checkpoint(reference, quantized, spec, tmp_path, tokenizer, config_file)

    engine = assert_serves_reference(directory, reference)
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.weight, Fp8Weight) and qkv.weight.weight.dtype == torch.float8_e4m3fn
    assert qkv.weight.group_size == (BLOCK[1] if scales == "block" else 0)


QUANTIZED_PROJECTION = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.(gate_proj|up_proj|down_proj|w[123]))\.weight")
"""The checkpoint tensors a quantized release quantizes: every decoder projection, experts included
(the routers, embeddings, norms and LM head stay as they are)."""


@pytest.mark.parametrize("fmt, kind", [("awq", "qwen3-moe"), ("gptq", "mixtral"), ("compressed-int4", "qwen3-moe"),
                                       ("compressed-tensors", "mixtral"), ("block-fp8", "qwen3-moe"),
                                       ("compressed-int8", "qwen3-moe")])
def test_mixture_of_experts_checkpoint_matches_transformers_on_the_dense_weights(fmt, kind, tmp_path, tokenizer):
    """Qwen3-MoE and Mixtral as their quantized releases ship (AWQ, GPTQ and compressed-tensors 4-bit;
    FP8 per channel and block-wise; compressed-tensors W8A16): every projection, the experts'
    included, quantized, the router not. The experts load stacked in their 4-bit, e4m3 or int8
    form (never dense) and the model generates
    transformers' tokens on the same weights dense."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    build(kind).save_pretrained(tmp_path / "dense")
    dense, quantized = {}, {}
    for name, tensor in load_file(tmp_path / "dense" / "model.safetensors").items():
        if not QUANTIZED_PROJECTION.search(name):
            dense[name] = quantized[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "compressed-int8":
            value, parts = int8_tensors("pack-quantized", "channel", *tensor.shape, rng)
        else:
            value, parts = fp8_tensors(tensor, fmt) if fmt in FP8_CONFIGS else int4_tensors(fmt, *tensor.shape, rng, 16)
        dense[name] = value.to(tensor.dtype).contiguous()
        quantized |= {f"{prefix}.{part}": t for part, t in parts.items()}
    save_file(dense, tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    out = tmp_path / "quantized"
    out.mkdir()
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    if fmt == "compressed-int8":
        spec = int8_spec("pack-quantized", "channel", False)
    elif fmt in FP8_CONFIGS:
        spec = FP8_CONFIGS[fmt][1]
    else:
        spec = INT4_CONFIGS[fmt] | ({} if fmt.startswith("compressed") else {"group_size": 16})
    spec = json.loads(json.dumps(spec))
    if fmt.startswith("compressed-int4"):
        spec["config_groups"]["group_0"]["weights"]["group_size"] = 16
    router = "re:.*mlp.gate$" if kind == "qwen3-moe" else "model.layers.0.block_sparse_moe.gate"
    for key in ("ignore", "modules_to_not_convert"):  # as the releases list their unquantized routers
        if key in spec or fmt == "block-fp8":
            spec[key] = [*(spec.get(key) or ["lm_head"]), router]
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": spec}))
    tokenizer.save_pretrained(out)

    engine = assert_serves_reference(str(out), reference)
    experts = engine.runner.model.decoder_layers[0].mlp.experts
    assert experts.form == {"compressed-int8": "int8"}.get(fmt, "fp8" if fmt in FP8_CONFIGS else "int4")
    assert engine.runner.model.decoder_layers[0].mlp.gate.weight.dtype == torch.float32


def int8_spec(fmt: str, strategy: str, activations: bool) -> dict:
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy}
    scheme = {"targets": ["Linear"], "weights": weights | ({"group_size": GROUP} if strategy == "group" else {})}
    if activations:  # W8A8: dynamic per-token int8 activations (read, then run as W8A16)
        scheme["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "config_groups": {"group_0": scheme}}


def int8_tensors(fmt: str, strategy: str, n: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, dict]:
    """A random int8 weight [N, K] as compressed-tensors' `fmt` stores it ({kind: tensor}), scales per
    channel or group of GROUP, and its dense value."""
    codes = torch.from_numpy(rng.integers(-127, 128, (n, k))).to(torch.int8)
    scale = torch.from_numpy(rng.uniform(1e-3, 3e-3, (n, k // GROUP if strategy == "group" else 1))).bfloat16()
    dense = codes.float() * scale.float().repeat_interleave(k // scale.shape[1], 1)
    if fmt == "int-quantized":
        return dense, {"weight": codes, "weight_scale": scale}
    stored = (codes.to(torch.int32) + 128).view(n, k // 4, 4) << (8 * torch.arange(4, dtype=torch.int32))
    return dense, {"weight_packed": stored.sum(-1, dtype=torch.int64).to(torch.uint32).view(torch.int32),
                   "weight_scale": scale, "weight_shape": torch.tensor([n, k])}


@pytest.mark.parametrize("fmt, strategy, activations", [
    ("pack-quantized", "channel", False), ("pack-quantized", "group", False), ("int-quantized", "channel", True)])
def test_int8_checkpoint_matches_transformers_on_the_dense_weights(fmt, strategy, activations, tmp_path, tokenizer):
    """llm-compressor's W8A16 (8-bit codes packed four to an int32, per channel or per group of 32) and
    W8A8 (int8 weights as stored, run with 16-bit activations): the codes run as they are through the
    8-bit GEMM and generate transformers' tokens on the same weights dense."""
    from pagedserve.kernels.fp8 import Int8Weight

    rng = np.random.default_rng(1)
    reference = llama_reference()
    quantized = {}
    for prefix, linear in projections(reference):
        dense, tensors = int8_tensors(fmt, strategy, *linear.weight.shape, rng)
        linear.weight.data.copy_(dense)
        quantized |= {f"{prefix}.{kind}": tensor for kind, tensor in tensors.items()}
    directory = write_checkpoint(reference, quantized, int8_spec(fmt, strategy, activations), tmp_path, tokenizer)

    engine = assert_serves_reference(directory, reference)
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.weight, Int8Weight) and qkv.weight.group_size == (GROUP if strategy == "group" else 0)


@pytest.mark.parametrize("spec, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "100-column blocks"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "in e5m2"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["model.layers.3.mlp"]},
     "unquantized"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt NVFP4"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}}}}, "symmetric False"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "channel"}}}}, "format 'int-quantized' with 4-bit"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "model.layers.0.mlp.down_proj"],
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, "unquantized"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
])
def test_checkpoint_quantizations_not_served_are_refused_by_name(spec, message):
    from pagedserve.backend.checkpoints.quantization_config import prequantized
    from pagedserve.backend.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        prequantized(spec)
