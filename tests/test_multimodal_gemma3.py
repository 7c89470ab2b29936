"""Gemma 3's images (backend/multimodal/): a tiny random Gemma3ForConditionalGeneration saved by
transformers gives transformers' greedy tokens with one and two images beside text, whole and with
a small token budget: its image tokens attend to their whole image (bidirectional spans, the torch
reference attention), so a prefill chunk never ends inside an image; a prefix hit may end inside one.
Each step's logprobs equal transformers' with that mask, and not without it."""

from __future__ import annotations

import pytest

from pagedserve.backend import LLMEngine

from .vlm_checks import GEMMA_IMAGE, TOKENS, assert_same, chat_text, greedy, pictures, transformers_greedy, write_tiny_gemma3

pytestmark = pytest.mark.slow

PROMPTS = [f"Describe the picture: {GEMMA_IMAGE} What is in it?",
           f"Compare {GEMMA_IMAGE} with {GEMMA_IMAGE} and tell the difference.",
           "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_greedy_equals_transformers(gemma, settings):
    images = pictures(3)
    expected = [transformers_greedy(gemma, PROMPTS[0], images[:1], TOKENS),
                transformers_greedy(gemma, PROMPTS[1], images[1:3], TOKENS),
                transformers_greedy(gemma, PROMPTS[2], [], TOKENS)]
    engine = LLMEngine(model=gemma, dtype="float32", **settings)
    prompts = [{"prompt": PROMPTS[0], "multi_modal_data": {"image": images[0]}},
               {"prompt": PROMPTS[1], "multi_modal_data": {"image": images[1:3]}}, PROMPTS[2]]
    assert_same(greedy(engine, prompts), expected)
    assert_same(greedy(engine, prompts), expected)  # prefix hits now


def test_chat_with_an_image(gemma):
    picture = pictures(1)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    expected = transformers_greedy(gemma, chat_text(gemma, messages), [picture], TOKENS)
    engine = LLMEngine(model=gemma, dtype="float32")
    assert_same(greedy(engine, [{"messages": messages, "multi_modal_data": {"image": picture}}]), [expected])


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16, "block_size": 8}], ids=["whole", "chunked"])
def test_logprobs_equal_transformers_with_the_image_mask_and_not_without(gemma, settings):
    """Beyond greedy tokens: each step's top logprobs equal transformers' with Gemma 3's image mask
    (its token_type_ids: an image's tokens see one another) to float32 rounding, and differ from
    transformers' logits without that mask by far more, so it is the mask both compute; again from a
    prefix hit. (The tiny
    checkpoint's projector is random: transformers starts it at zero, which makes every image token
    the same row and the mask invisible.)"""
    import torch
    from transformers import AutoModelForImageTextToText

    from pagedserve.backend import SamplingParams
    from pagedserve.backend.multimodal.processor import load_processor

    images = pictures(3)
    processor = load_processor(gemma)
    model = AutoModelForImageTextToText.from_pretrained(gemma, dtype=torch.float32).eval()
    engine = LLMEngine(model=gemma, dtype="float32", **settings)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    for prompt, pictured in ((PROMPTS[0], images[:1]), (PROMPTS[1], images[1:3])):
        [ours] = engine.generate([{"prompt": prompt, "multi_modal_data": {"image": pictured}}], params, use_tqdm=False)
        inputs = processor(images=pictured, text=prompt, return_tensors="pt")
        length = inputs["input_ids"].shape[1]
        ids = torch.cat([inputs["input_ids"], torch.tensor([ours.token_ids[:-1]])], dim=1)
        kinds = torch.nn.functional.pad(inputs["token_type_ids"], (0, len(ours.token_ids) - 1))
        with torch.no_grad():
            masked = model(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=kinds).logits[0, length - 1:]
            causal = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0, length - 1:]
        masked, causal = masked.log_softmax(-1), causal.log_softmax(-1)
        [again] = engine.generate([{"prompt": prompt, "multi_modal_data": {"image": pictured}}], params, use_tqdm=False)
        assert again.num_cached_tokens > 0  # its image blocks from the prefix cache
        for run in (ours, again):
            for step, logprob in enumerate(run.logprobs):
                for token, value in logprob.top:
                    assert value == pytest.approx(masked[step, token].item(), abs=2e-4), (prompt, step, token)
        assert max(abs(value - causal[0, token].item()) for token, value in ours.logprobs[0].top) > 1e-2
