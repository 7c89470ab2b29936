"""Llama-family models (Llama 3 and YaRN rope scaling, Mistral, Qwen2 with qkv bias, Qwen3 with
its per-head query / key norms, Granite with its multipliers, OLMo 2 with its norms after each
sublayer and over whole query / key projections, tied and untied embeddings) load from sharded
safetensors and match transformers, token for token (and Granite's scaled logits in their
log-probabilities); the rope scalings' frequencies are transformers' own."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams

from .conftest import GPU_SHARE, assert_greedy_matches_transformers, onednn_packs

pytestmark = pytest.mark.slow

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, initializer_range=0.3)


WINDOWED = {"mistral": (0, 1), "mixtral": (0, 1), "gemma2": (0,), "qwen2-window": (1,), "phi3": (0, 1), "gemma3": (0,),
            "gpt-oss": (0,)}
"""The kinds with sliding-window layers, and which."""


def build(kind: str):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                              Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, GptOssConfig,
                              GptOssForCausalLM)

    if kind == "llama3":
        config = LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return LlamaForCausalLM(config)
    if kind == "mistral":  # a window of 24: the 90- and 42-token prompts and their chunks run past it
        return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=24, tie_word_embeddings=False))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True))
    if kind == "qwen2-window":  # the second layer alone attends within a window of 20 (max_window_layers)
        return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=True,
                                            sliding_window=20, max_window_layers=1))
    if kind == "qwen3":  # head_dim apart from hidden / heads, as Qwen3's configs have it
        return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False))
    if kind == "mixtral":  # 8 experts, 2 a token, renormalized; a window of 24 as Mistral's
        return MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2, sliding_window=24,
                                                tie_word_embeddings=False))
    if kind == "qwen3-moe":  # 8 experts of width 48, 3 a token, weights not renormalized; the second layer dense
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                                  moe_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                                                  tie_word_embeddings=False))
    if kind == "llama-tied":
        return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True))
    if kind == "llama-yarn":  # a 90-token prompt runs past the original 64 positions; 256 = 64 x 4
        config = LlamaConfig(**{**COMMON, "max_position_embeddings": 256}, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        return LlamaForCausalLM(config)
    if kind == "granite":  # Granite 3's own embedding and residual multipliers; a softmax scale 1/4 of 1/sqrt(16)
        return GraniteForCausalLM(GraniteConfig(**COMMON, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                attention_multiplier=0.0625, logits_scaling=8.0))
    if kind == "olmo2":  # Llama's special tokens: OLMo 2's pad id 1 would mask the prompts' first token in generate
        return Olmo2ForCausalLM(Olmo2Config(**COMMON, tie_word_embeddings=False, pad_token_id=None, bos_token_id=1,
                                            eos_token_id=2))
    if kind == "phi3":  # q/k/v and gate/up stacked in the checkpoint; Llama's special tokens (Phi-3's pad id masks)
        return Phi3ForCausalLM(Phi3Config(**COMMON, pad_token_id=None, bos_token_id=1, eos_token_id=2, sliding_window=30))
    if kind == "phi4-mini":  # 3/4 of each head turned by rotary, LongRoPE (original context 128 of 512), tied embeddings
        config = Phi3Config(**COMMON, pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                            original_max_position_embeddings=128,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                             "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})
        return Phi3ForCausalLM(config)
    if kind == "gemma2":  # Gemma 3's layer less its q/k norms and local rope, plus soft-capped attention scores
        return Gemma2ForCausalLM(Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                                              attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
                                              pad_token_id=None, bos_token_id=1, eos_token_id=2))
    if kind == "gemma3":  # 4 norms a layer (offset weights), GELU, per-layer rope bases, softcapped logits, tied
        config = Gemma3TextConfig(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0}},
                                  pad_token_id=None, bos_token_id=1, eos_token_id=2)
        return Gemma3ForCausalLM(config)
    if kind == "gpt-oss":  # sinks, biased experts (8, 2 a token) with the clamped SwiGLU, window 24 then global, YaRN
        config = GptOssConfig(**{**COMMON, "initializer_range": 0.1}, head_dim=16, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
        return GptOssForCausalLM(config)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["llama3", "mistral", "mixtral", "qwen2", "qwen2-window", "qwen3", "qwen3-moe",
                                  "llama-tied", "llama-yarn", "granite", "olmo2", "phi3", "phi4-mini", "gemma2", "gemma3",
                                  "gpt-oss"])
def test_random_checkpoint_matches_transformers(kind, tmp_path, tokenizer):
    torch.manual_seed(0)
    reference = make_biases_and_norms_matter(build(kind).eval(), kind)
    reference.save_pretrained(tmp_path, max_shard_size="2MB")  # several shards + index
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()

    # a 32-token step budget chunks the longer prompts; the second batch's prompts are prefix hits
    engine = LLMEngine(model=str(tmp_path), dtype="float32", max_num_batched_tokens=32, **GPU_SHARE)
    prompts = [[1, 500, 42, 9000, 123], list(range(200, 290)), [7] * 40 + [1000, 2000]]
    assert_greedy_matches_transformers(engine, reference, prompts, max_tokens=12)
    assert_greedy_matches_transformers(engine, reference, prompts[1:], max_tokens=12)
    again = engine.generate(prompts[1:], SamplingParams(max_tokens=1, temperature=0, logprobs=0), use_tqdm=False)
    assert all(output.num_cached_tokens >= 32 for output in again)
    with torch.inference_mode():  # the logits' scale too (greedy tokens do not see Granite's logits_scaling)
        expected = reference(torch.tensor([prompts[1]])).logits[0, -1].float().log_softmax(-1)
    assert again[0].logprobs[0].logprob == pytest.approx(expected[again[0].token_ids[0]].item(), abs=1e-4)
    if kind in WINDOWED:  # the whole context is served, each window where the checkpoint puts it
        assert engine.max_model_len == 512 and engine.model_config.sliding_layers == WINDOWED[kind]
    if kind in ("mixtral", "qwen3-moe", "gpt-oss"):
        assert engine.model_config.moe_layers == ((0,) if kind == "qwen3-moe" else (0, 1))
    if kind == "phi4-mini":  # LongRoPE's context: the original one, where its short factors are exact
        assert engine.max_model_len == 128 and engine.model_config.rotary_dim == 12


def make_biases_and_norms_matter(reference, kind: str):
    """`reference` with the weights its kind initializes to zero or one drawn at random, so that a
    loader dropping them shows."""
    if kind in ("qwen2", "qwen2-window", "llama-tied"):  # make the biases matter: Qwen2's on q/k/v, attention_bias's on o too
        for layer in reference.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                if proj.bias is not None:
                    torch.nn.init.normal_(proj.bias, std=0.5)
    if kind in ("qwen3", "qwen3-moe"):  # and the per-head norms' weights
        for layer in reference.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)
    if kind == "gpt-oss":  # its sinks, attention and expert biases (zero as initialized) and norms
        for name, weight in reference.named_parameters():
            if name.endswith(("sinks", "bias")):
                torch.nn.init.normal_(weight, std=0.5)
            elif name.endswith("norm.weight"):
                torch.nn.init.normal_(weight, mean=1.0, std=0.3)
    if kind in ("olmo2", "gemma2", "gemma3"):  # every norm's: around attention and MLP, over q / k, the final one (Gemma: offsets)
        for name, weight in reference.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(weight, mean=1.0, std=0.5)
    return reference


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.9},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_scalings_give_the_frequencies_transformers_computes(scaling):
    """Each rope scaling of a config.json gives transformers' inverse frequencies and cos / sin
    factor to the bit. Dynamic NTK: transformers' at factor x max_position_embeddings, the one base
    the engine keeps (vLLM's); transformers itself uses the plain base up to max_position_embeddings
    and a longer sequence's own length beyond, which no fixed table gives."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedserve.backend.checkpoints.hf import hf_model_config
    from pagedserve.backend.models.rope import rope_frequencies

    hf = LlamaConfig(**{**COMMON, "max_position_embeddings": 256}, rope_scaling=dict(scaling))
    inv_freq, attention_factor = rope_frequencies(hf_model_config(hf.to_dict()))
    kind = scaling["rope_type"]
    seq_len = int(scaling["factor"] * hf.max_position_embeddings) if kind == "dynamic" else None
    expected, expected_factor = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"), seq_len=seq_len)
    assert torch.equal(inv_freq, expected)
    assert attention_factor == expected_factor


def test_generation_config_gives_eos_lists_and_the_sampling_defaults_vllm_takes():
    """Llama 3.1's generation_config.json: its EOS list joins config.json's id; temperature and top_p
    become the model's defaults (what `use_model_defaults` requests get), top_k 50 and do_sample do
    not (transformers' default and no sampling field: vLLM's get_diff_sampling_param drops them)."""
    from transformers import LlamaConfig

    from pagedserve.backend.checkpoints.hf import hf_model_config

    config = LlamaConfig(**COMMON, eos_token_id=128001).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "eos_token_id": [128001, 128008, 128009]}
    model = hf_model_config(config, generation)
    assert model.eos_token_ids == [128001, 128008, 128009]
    assert model.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert hf_model_config(config).generation_defaults == {}


def test_olmo2_norms_round_as_transformers_does_in_bf16():
    """OLMo 2's RMSNorm multiplies by its weight before rounding to bf16, Llama's after (hundreds
    of the values below differ): norm_rounds_once gives OLMo 2's to the bit, beside an add too."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from pagedserve.backend.models.llama import RMSNorm

    torch.manual_seed(0)
    weight = torch.randn(64) * 0.5 + 1
    norms = [RMSNorm(64, 1e-5, rounds_once=True), Olmo2RMSNorm(64, 1e-5), LlamaRMSNorm(64, 1e-5)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(weight)
    ours, olmo2, llama = (norm.to(torch.bfloat16) for norm in norms)
    h, delta = (torch.randn(33, 64) * 3).bfloat16(), torch.randn(33, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(delta), olmo2(delta)) and not torch.equal(olmo2(delta), llama(delta))
        total, normed = ours.add_and_norm(h, delta)
        assert torch.equal(total, h + delta) and torch.equal(normed, olmo2(h + delta))


def test_olmo2_is_not_split_over_ranks():
    """Its query / key norms span every head's output: a rank with some heads cannot norm them."""
    from pagedserve.backend.errors import ConfigError
    from pagedserve.backend.model_config import ModelConfig
    from pagedserve.backend.models.parallel import check_tensor_parallel

    config = ModelConfig("olmo2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                         qk_norm=True, qk_norm_across_heads=True, sublayer_output_norms=True, norm_rounds_once=True)
    check_tensor_parallel(config, 1)
    with pytest.raises(ConfigError, match="span every head.*tensor_parallel_size=1") as info:
        check_tensor_parallel(config, 2)
    assert info.value.field == "tensor_parallel_size"


def test_row_buckets_are_few_and_never_smaller():
    from pagedserve.backend.cpu.linear_methods import EXACT_ROWS
    from pagedserve.backend.models.linear import row_bucket

    for exact in (16, EXACT_ROWS):  # the compiled step's graphs; the eager step's oneDNN kernels
        buckets = {row_bucket(rows, exact) for rows in range(1, 2049)}
        assert all(row_bucket(rows, exact) == rows for rows in range(1, exact + 1))  # a decode batch is never padded
        assert all(row_bucket(rows, exact) >= rows for rows in range(1, 4096))
        assert all(row_bucket(rows, exact) - rows < (16 if rows <= 256 else 64 if rows <= 1024 else 256) for rows in range(1, 4096))
        assert len(buckets) <= exact + (256 - exact) // 16 + 12 + 4  # under a hundred shapes per layer, not one per token count




def test_a_mixture_of_experts_checkpoint_that_lacks_an_expert_is_refused(tmp_path, tokenizer):
    """A missing expert tensor is named."""
    from safetensors.torch import load_file, save_file

    from pagedserve.backend.errors import ConfigError

    torch.manual_seed(0)
    build("qwen3-moe").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.experts\.5\.up_proj"):
        LLMEngine(model=str(tmp_path), dtype="float32", **GPU_SHARE)


def dequantized(weight) -> torch.Tensor:
    """A quantized linear's or expert's weight [N, K], dense in float32."""
    from pagedserve.kernels.fp8 import Fp8Weight, dequantize_fp8
    from pagedserve.kernels.int4 import dequantize_int4

    return dequantize_fp8(weight) if isinstance(weight, Fp8Weight) else dequantize_int4(weight)


@pytest.mark.parametrize("method, form", [("fp8", torch.float8_e4m3fn), ("int4", torch.int32)])
def test_quantization_on_load_quantizes_the_experts_and_serves_their_dequantized_weights(method, form, tmp_path,
                                                                                          tokenizer):
    """quantization fp8 / int4 on Mixtral: the experts of every layer but the last (kept exact, as the
    dense linears' policy) become e4m3 with channel scales / 4-bit codes with group scales and
    offsets, the router stays exact, and the engine generates transformers' tokens on the weights its
    quantized layers hold, dequantized (so the experts' quantized path computes what those weights
    say, token for token)."""
    torch.manual_seed(0)
    reference = build("mixtral").eval()
    reference.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = LLMEngine(model=str(tmp_path), dtype="float32", quantization=method, **GPU_SHARE)
    ours = engine.runner.model.decoder_layers
    assert ours[0].mlp.w13.dtype == form and ours[0].mlp.w2_scale is not None
    assert ours[0].mlp.gate.weight.dtype == torch.float32 and ours[-1].mlp.w13.dtype == torch.float32
    with torch.no_grad():
        for layer, theirs in zip(ours[:-1], reference.model.layers):
            attn = theirs.self_attn
            q, k, v = dequantized(layer.self_attn.qkv_proj.weight).split(
                [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features])
            for linear, value in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v),
                                  (attn.o_proj, dequantized(layer.self_attn.o_proj.weight))):
                linear.weight.copy_(value)
            experts = layer.mlp.experts
            for e in range(experts.num_experts):
                theirs.mlp.experts.gate_up_proj[e].copy_(dequantized(experts.projection("w13", e)))
                theirs.mlp.experts.down_proj[e].copy_(dequantized(experts.projection("w2", e)))
    prompts = [[1, 500, 42, 9000, 123], list(range(200, 290)), [7] * 40 + [1000, 2000]]
    assert_greedy_matches_transformers(engine, reference, prompts, max_tokens=8)
