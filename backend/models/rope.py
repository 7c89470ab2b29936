"""Rotary frequencies as transformers computes them for a config's rope scaling: none, linear,
llama3, YaRN, LongRoPE, dynamic NTK (one fixed base). models/llama.py's RotaryEmbedding turns
them into cos / sin tables."""

from __future__ import annotations

import math

import torch

from ..model_config import ModelConfig


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the factor cos and sin are multiplied by (YaRN's attention factor,
    else 1), as transformers' modeling_rope_utils computes them for the config's rope scaling:
    none, linear, llama3, yarn, longrope, or dynamic (NTK), the last with one fixed base
    (`_dynamic_ntk_base`); over the rotary share of each head (`rotary_dim`)."""
    dim = config.rotary_dim
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    base = _dynamic_ntk_base(config, float(scaling["factor"])) if kind == "dynamic" else config.rope_theta
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / powers
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "yarn":
        return _yarn_frequencies(config, scaling, powers)
    if kind == "longrope":
        return _longrope_frequencies(scaling, powers)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind not in (None, "default", "dynamic"):
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn, longrope, dynamic are)")
    return inv_freq, 1.0


def _longrope_frequencies(scaling: dict, powers: torch.Tensor) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 / Phi-4, transformers' _compute_longrope_parameters) within the original
    context: each frequency divided by its short factor, and cos / sin multiplied by
    sqrt(1 + ln(factor) / ln(original)) unless the config gives the attention factor. Past the
    original context transformers switches every position to the long factors, keys already cached
    keeping the short ones, which no paged cache can replay: the checkpoint reader caps the context
    at the original (checkpoints/hf.py), where the short factors are transformers' own."""
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0 / (short * powers), float(attention_factor)


def _dynamic_ntk_base(config: ModelConfig, factor: float) -> float:
    """Dynamic NTK's rotary base, fixed for a context of factor * max_position_embeddings, as vLLM
    computes it. transformers recomputes the base in each forward from that forward's longest
    position (keeping the plain base up to max_position_embeddings), while the keys already cached
    keep the base they were rotated with: a paged engine that shares and chunks prefixes cannot
    reproduce that history, so it takes vLLM's one base (transformers' formula at that length)."""
    dim, context = config.head_dim, config.max_position_embeddings
    seq_len = factor * context
    return config.rope_theta * ((factor * seq_len / context) - (factor - 1)) ** (dim / (dim - 2))


def _yarn_frequencies(config: ModelConfig, scaling: dict, powers: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): each frequency a blend of itself (fast ones,
    many turns within the original context) and itself / factor (slow ones), over a linear ramp
    between the dimensions that turn beta_fast and beta_slow times; and the attention factor,
    0.1 ln(factor) + 1 unless the config gives it (or mscale / mscale_all_dim)."""
    dim = config.head_dim
    base = config.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, weight) / mscale(factor, weight_all) if weight and weight_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    inv_freq = 1.0 / (factor * powers) * (1 - extrapolated) + 1.0 / powers * extrapolated
    return inv_freq, float(attention_factor)
