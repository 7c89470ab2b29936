"""AWQ (GEMM) and GPTQ 4-bit checkpoints load into the fused INT4 layers and generate what
transformers generates with the same weights in dense form."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedserve.backend import LLMEngine

from .conftest import GPU_SHARE, assert_greedy_matches_transformers
from .test_models import COMMON

pytestmark = pytest.mark.slow

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds column 8c + AWQ_ORDER[i]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] nibbles -> int32 words, nibble i at bits 4i."""
    shifted = nibbles.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
    return torch.from_numpy(np.bitwise_or.reduce(shifted, axis=-1).view(np.int32))


def pack(fmt: str, codes: np.ndarray, zeros: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [K, N] and zeros [K/G, N] (0..15) in the checkpoint's packing."""
    k, n = codes.shape
    if fmt == "awq":  # both packed along N, interleaved
        order = list(AWQ_ORDER)
        return words(codes.reshape(k, n // 8, 8)[..., order]), words(zeros.reshape(-1, n // 8, 8)[..., order])
    # GPTQ v1: qweight sequential along K, qzeros sequential along N storing zero - 1
    qweight = words(codes.reshape(k // 8, 8, n).transpose(0, 2, 1))
    return qweight, words((zeros - 1).reshape(-1, n // 8, 8) & 15)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_packed_checkpoint_matches_transformers_on_the_dense_weights(fmt, tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False)).eval()
    packed = {}
    for index, layer in enumerate(reference.model.layers):
        for name in PROJECTIONS:
            linear = layer.get_submodule(name)
            n, k = linear.weight.shape
            codes = rng.integers(0, 16, (k, n))
            zeros = rng.integers(1, 16, (k // GROUP, n))
            scales = torch.from_numpy(rng.uniform(0.02, 0.08, (k // GROUP, n))).half()
            dense = (torch.from_numpy(codes - np.repeat(zeros, GROUP, axis=0)).float() * scales.float().repeat_interleave(GROUP, 0))
            linear.weight.data.copy_(dense.t())
            qweight, qzeros = pack(fmt, codes, zeros)
            prefix = f"model.layers.{index}.{name}"
            packed |= {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
            if fmt == "gptq":
                packed[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
    dense_dir, packed_dir = tmp_path / "dense", tmp_path / "packed"
    reference.save_pretrained(dense_dir)
    rest = {k: v for k, v in reference.state_dict().items() if not any(p in k for p in PROJECTIONS)}
    packed_dir.mkdir()
    save_file({**rest, **packed}, packed_dir / "model.safetensors")
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": fmt, "bits": 4, "group_size": GROUP, "version": "gemm", "desc_act": False}
    (packed_dir / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(packed_dir)

    engine = LLMEngine(model=str(packed_dir), dtype="float32", **GPU_SHARE)
    assert type(engine.runner.model.layers[0].self_attn.qkv_proj).__name__ == "QuantizedLinear"
    prompts = [[1, 500, 42, 9000, 123], list(range(300, 340))]
    assert_greedy_matches_transformers(engine, reference, prompts, max_tokens=10)
