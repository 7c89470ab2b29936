"""fp8 KV cache scales, calibrated once at load.

Scales are fixed before serving: cached entries must keep the scale they were
written with. One full-precision prefill of varied text records each layer's
K and V amax; the scale leaves headroom above it before fp8 saturates.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.numerics import FP8_MAX, cdiv

from .attention import TORCH_KERNELS, AttentionKernels
from .model_runner import ModelRunner

# Varied prose, code, numbers and chat markup.
CALIBRATION_TEXT = (
    "Photosynthesis converts light energy into chemical energy stored in glucose. In 1969 the Apollo 11 "
    "crew landed on the Moon; Neil Armstrong stepped out first. def mean(xs):\n    return sum(xs) / len(xs)\n"
    "Q: What is 17 times 23? A: 391. The quick brown fox jumps over the lazy dog. Markets rose 2.5% on "
    "Tuesday after the central bank held rates steady. <|im_start|>user\nCan you suggest a recipe for "
    "dinner?<|im_end|>\n<|im_start|>assistant\nSure! A simple pasta with garlic, olive oil and chili takes "
    "fifteen minutes. Bonjour, comment allez-vous ? Ich lerne Deutsch. 日本語も少し話せます。"
)
MARGIN = 2.0  # headroom above the calibrated amax


def calibrate_kv_scales(runner: ModelRunner, token_ids: list[int]) -> None:
    """Set every layer's k_scale and v_scale of the runner's fp8 KV cache."""
    num_blocks = cdiv(len(token_ids), runner.block_size)
    scratch = runner.allocate_kv(num_blocks, runner.model.embed_tokens.weight.dtype)
    layer_of = {id(kv.key): i for i, kv in enumerate(scratch)}
    amax = [[0.0, 0.0] for _ in scratch]

    def recording_write(key, value, key_cache, value_cache, slot_mapping, **scales):
        layer = layer_of[id(key_cache)]
        amax[layer][0] = max(amax[layer][0], key.abs().max().item())
        amax[layer][1] = max(amax[layer][1], value.abs().max().item())
        TORCH_KERNELS.write_cache(key, value, key_cache, value_cache, slot_mapping, **scales)

    recorder = AttentionKernels(write_cache=recording_write, attend=TORCH_KERNELS.attend)
    with torch.inference_mode():
        runner.run_prefill(token_ids, list(range(num_blocks)), kv_caches=scratch, attention=recorder)
    for kv, (k_max, v_max) in zip(runner.kv_caches, amax):
        kv.k_scale = max(k_max, 1e-6) * MARGIN / FP8_MAX
        kv.v_scale = max(v_max, 1e-6) * MARGIN / FP8_MAX
