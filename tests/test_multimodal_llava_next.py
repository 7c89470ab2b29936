"""LLaVA-NeXT and LLaVA-OneVision (backend/multimodal/): tiny random checkpoints saved by
transformers tile each picture on the grid its shape picks (so pictures of other shapes have other
token counts) with a newline row after each row of tiles; the engine gives transformers' greedy
tokens with one and two pictures beside text, whole and chunked, with prefix hits and in chat.
OneVision's processor loads without its video part (which needs torchvision)."""

from __future__ import annotations

import pytest

from pagedserve.backend import LLMEngine

from .vlm_checks import (IMAGE_TOKEN, assert_chat_equals_transformers, assert_mixed_batch_equals_transformers,
                         mixed_requests, pictures, write_tiny_llava_next, write_tiny_llava_onevision)

pytestmark = pytest.mark.slow

PROMPTS = [f"Describe the picture: {IMAGE_TOKEN} What is in it?",
           f"Compare {IMAGE_TOKEN} with {IMAGE_TOKEN} and tell the difference.",
           "The quick brown fox jumps over the lazy dog"]
WRITERS = {"llava-next": write_tiny_llava_next, "llava-onevision": write_tiny_llava_onevision}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def checkpoint(request, tmp_path_factory) -> str:
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole-prompts", "chunks-of-16"])
def test_greedy_equals_transformers(checkpoint, chunk):
    engine = LLMEngine(model=checkpoint, dtype="float32", **({"max_num_batched_tokens": chunk} if chunk else {}))
    _, mm = engine.prompt_inputs(mixed_requests(PROMPTS, pictures(3))[1])
    assert mm.images[0].length != mm.images[1].length  # 50x30 and 64x64 tile differently
    assert_mixed_batch_equals_transformers(checkpoint, PROMPTS, engine)


def test_chat_with_an_image(checkpoint):
    assert_chat_equals_transformers(checkpoint, LLMEngine(model=checkpoint, dtype="float32"))
