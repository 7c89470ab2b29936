"""Gemma 3's images (backend/multimodal/): a tiny random Gemma3ForConditionalGeneration saved by
transformers gives transformers' greedy tokens with one and two images beside text, whole and with
a small token budget: its image tokens attend to their whole image (bidirectional spans, the torch
reference attention), so a prefill chunk never ends inside an image; a prefix hit may end inside one.
Each step's logprobs equal transformers' with that mask, and not without it; with pan-and-scan too
(mm_processor_kwargs)."""

from __future__ import annotations

import json

import pytest

from pagedserve.backend import LLMEngine, SamplingParams

from .vlm_checks import (GEMMA_IMAGE, assert_chat_equals_transformers, assert_mixed_batch_equals_transformers, pictures,
                         write_tiny_gemma3)

pytestmark = pytest.mark.slow

PROMPTS = [f"Describe the picture: {GEMMA_IMAGE} What is in it?",
           f"Compare {GEMMA_IMAGE} with {GEMMA_IMAGE} and tell the difference.",
           "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_greedy_equals_transformers(gemma, settings):
    assert_mixed_batch_equals_transformers(gemma, PROMPTS, LLMEngine(model=gemma, dtype="float32", **settings))


def test_chat_with_an_image(gemma):
    assert_chat_equals_transformers(gemma, LLMEngine(model=gemma, dtype="float32"))


def transformers_logprobs(gemma: str, prompt: str, pictured: list, generated: list[int], mask: bool = True,
                          **processor_kwargs):
    """transformers' log-probabilities at each generated position of `prompt` + `generated` with its
    images through the checkpoint's processor (`processor_kwargs` beside), with Gemma 3's image mask
    (token_type_ids) or without it."""
    import torch
    from transformers import AutoModelForImageTextToText

    from pagedserve.backend.multimodal.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(gemma, dtype=torch.float32).eval()
    processor = load_processor(gemma)
    inputs = processor(images=pictured, text=prompt, return_tensors="pt", **processor_kwargs)
    length = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([generated[:-1]])], dim=1)
    kinds = torch.nn.functional.pad(inputs["token_type_ids"], (0, len(generated) - 1)) if mask else None
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=kinds).logits
    return logits[0, length - 1:].log_softmax(-1)


def assert_logprobs_equal(ours, theirs) -> None:
    """Each step's top logprobs of an engine's completion within float32 rounding of transformers'."""
    for step, logprob in enumerate(ours.logprobs):
        for token, value in logprob.top:
            assert value == pytest.approx(theirs[step, token].item(), abs=2e-4), (step, token)


LOGPROBS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_logprobs_equal_transformers_with_the_image_mask_and_not_without(gemma, settings):
    """Beyond greedy tokens: each step's top logprobs equal transformers' with Gemma 3's image mask
    (its token_type_ids: an image's tokens see one another) to float32 rounding, and differ from
    transformers' logits without that mask by far more, so it is the mask both compute; again from a
    prefix hit. (The tiny checkpoint's projector is random: transformers starts it at zero, which makes
    every image token the same row and the mask invisible.)"""
    images = pictures(3)
    engine = LLMEngine(model=gemma, dtype="float32", **settings)
    for prompt, pictured in ((PROMPTS[0], images[:1]), (PROMPTS[1], images[1:3])):
        request = {"prompt": prompt, "multi_modal_data": {"image": pictured}}
        [ours] = engine.generate([request], LOGPROBS, use_tqdm=False)
        [again] = engine.generate([request], LOGPROBS, use_tqdm=False)
        assert again.num_cached_tokens > 0  # its image blocks from the prefix cache
        masked = transformers_logprobs(gemma, prompt, pictured, ours.token_ids)
        assert_logprobs_equal(ours, masked)
        assert_logprobs_equal(again, masked)
        causal = transformers_logprobs(gemma, prompt, pictured, ours.token_ids, mask=False)
        assert max(abs(value - causal[0, token].item()) for token, value in ours.logprobs[0].top) > 1e-2


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}
"""Crops of a wide or tall picture beside it (the tiny pictures are 32 pixels a side when resized)."""


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_pan_and_scan_through_mm_processor_kwargs(gemma, settings):
    """mm_processor_kwargs reach the checkpoint's processor: with pan-and-scan a wide picture brings
    crops of itself, each a run of image tokens of its own between words; the engine's logprobs equal
    transformers' with the same settings (two pictures of 60x40 and 30x50: two crops each), and a
    setting the image processor does not have is refused by name at load."""
    from pagedserve.backend.errors import ConfigError

    images = pictures(2)
    engine = LLMEngine(model=gemma, dtype="float32", mm_processor_kwargs=json.dumps(PAN_AND_SCAN), **settings)
    request = {"prompt": PROMPTS[1], "multi_modal_data": {"image": images}}
    ids, mm = engine.prompt_inputs(request)
    assert len(mm.images) == 6 and len({image.content_hash for image in mm.images}) == 6  # two originals, four crops
    [ours] = engine.generate([request], LOGPROBS, use_tqdm=False)
    assert_logprobs_equal(ours, transformers_logprobs(gemma, PROMPTS[1], images, ours.token_ids, **PAN_AND_SCAN))
    [again] = engine.generate([request], LOGPROBS, use_tqdm=False)
    assert again.num_cached_tokens > 0 and again.token_ids == ours.token_ids
    with pytest.raises(ConfigError, match="mm_processor_kwargs.*'do_pan_and_scam' is not a setting of Gemma3ImageProcessor"):
        LLMEngine(model=gemma, dtype="float32", mm_processor_kwargs="do_pan_and_scam=true")
