"""Gemma 3's images (backend/multimodal/): a tiny random Gemma3ForConditionalGeneration saved by
transformers gives transformers' greedy tokens with one and two images beside text, whole and with
a small token budget: its image tokens attend to their whole image (bidirectional spans, the torch
reference attention), so a prefill chunk never ends inside an image; a prefix hit may end inside one."""

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
