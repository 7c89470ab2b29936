"""gpt-oss as OpenAI ships it: MXFP4 experts held and run as MXFP4 (their dequantized values
transformers' to the bit), the checkpoint's stacked experts read per expert, and what is refused
by name. (The bf16 checkpoint's greedy
equality with transformers, sinks, biases, window and all, is test_models.py's.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.backend import LLMEngine
from pagedserve.kernels.mxfp4 import dequantize_mxfp4

from .conftest import GPU_SHARE, assert_greedy_matches_transformers
from .test_models import build, make_biases_and_norms_matter

pytestmark = pytest.mark.slow


def test_mxfp4_dequantizes_as_transformers_does():
    """Every e2m1 code in both nibbles, scales from 2^-20 to 2^10: transformers' own conversion, to
    the bit, in bfloat16."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # 0x00, 0x11, ..., 0xFF
    scales = torch.randint(127 - 20, 127 + 11, (3, 5, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.dtype == torch.bfloat16 and ours.shape == (3, 5, 128)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales).transpose(1, 2))


def mxfp4_codes(g: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales of [experts, rows, cols] weights: values up to 6 x 2^-4."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    return blocks, torch.randint(127 - 7, 127 - 3, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)


def write_mxfp4_release(reference, directory, tokenizer) -> str:
    """`reference` (a transformers gpt-oss) as OpenAI's release lays it out: its experts random MXFP4
    (*_blocks / *_scales, their dequantized values copied into `reference`) beside bf16 attention,
    router, biases and sinks, quantization_config mxfp4. Returns the checkpoint's folder."""
    g = torch.Generator().manual_seed(1)
    quantized = {}
    for index, layer in enumerate(reference.model.layers):
        experts = layer.mlp.experts
        for name, (rows, cols) in {"gate_up_proj": (2 * experts.intermediate_size, experts.hidden_size),
                                   "down_proj": (experts.hidden_size, experts.intermediate_size)}.items():
            blocks, scales = mxfp4_codes(g, experts.num_experts, rows, cols)
            getattr(experts, name).data.copy_(dequantize_mxfp4(blocks, scales).float().transpose(1, 2))
            prefix = f"model.layers.{index}.mlp.experts.{name}"
            quantized |= {f"{prefix}_blocks": blocks, f"{prefix}_scales": scales}
    reference.save_pretrained(directory / "dense")
    rest = {k: v for k, v in reference.state_dict().items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    out = directory / "mxfp4"
    out.mkdir()
    save_file({**rest, **quantized}, out / "model.safetensors")
    config = json.loads((directory / "dense" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(out)
    return str(out)


def test_the_mxfp4_release_matches_transformers_on_the_dequantized_weights(tmp_path, tokenizer):
    """OpenAI's layout (write_mxfp4_release). Served with the experts as MXFP4, greedy equal to
    transformers on the same weights dense."""
    torch.manual_seed(0)
    reference = make_biases_and_norms_matter(build("gpt-oss").eval(), "gpt-oss")
    out = write_mxfp4_release(reference, tmp_path, tokenizer)

    engine = LLMEngine(model=out, dtype="float32", **GPU_SHARE)
    experts = engine.runner.model.decoder_layers[0].mlp.experts
    assert experts.form == "mxfp4" and experts.w13.dtype == torch.uint8  # held as shipped, never dense
    assert_greedy_matches_transformers(engine, reference, [[1, 500, 42, 9000, 123], list(range(300, 340))], max_tokens=10)


def test_what_gpt_oss_is_not_served_with_is_refused_by_name():
    from pagedserve.backend.checkpoints.hf import hf_model_config
    from pagedserve.backend.errors import ConfigError

    config = build("gpt-oss").config.to_dict() | {"architectures": ["GptOssForCausalLM"]}
    model = hf_model_config(config)
    assert model.attention_sinks and model.expert_bias and model.clamped_swiglu == (1.702, 7.0)
    with pytest.raises(ConfigError, match="gpt-oss checkpoints quantized with 'awq'"):
        hf_model_config(config | {"quantization_config": {"quant_method": "awq"}})
    from pagedserve.backend.models.parallel import check_tensor_parallel

    mxfp4 = hf_model_config(config | {"quantization_config": {"quant_method": "mxfp4"}})
    assert mxfp4.mxfp4_experts and not model.mxfp4_experts
    check_tensor_parallel(mxfp4, 2)  # 128 / 2 = 64: whole 32-input blocks
    with pytest.raises(ConfigError, match="32-input MXFP4 blocks over 8 ranks"):  # before any rank builds its layers
        check_tensor_parallel(mxfp4, 8)
