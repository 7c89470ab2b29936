"""Qwen2.5-VL and Qwen2-VL offline (backend/multimodal/): a tiny random checkpoint of each, saved by
transformers, loaded as a real one is (its processor's video part needs torchvision, which serving images does not: the
image part alone is built), gives transformers' greedy tokens with one and two images of different
sizes (their own token counts), beside text, whole and chunked, with prefix hits and in chat: the
image tokens turn by their time / height / width positions and every later token by its index plus
the image's shift (multimodal rotary positions), in the decode graphs' static buffers too."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend import LLMEngine

from .conftest import GPU_SHARE
from .test_cuda_graphs import _with_static_decode
from .vlm_checks import (QWEN_IMAGE, assert_chat_equals_transformers, assert_mixed_batch_equals_transformers,
                         write_tiny_qwen2_vl, write_tiny_qwen25_vl)

pytestmark = pytest.mark.slow

PROMPTS = [f"Describe the picture: {QWEN_IMAGE} What is in it?",
           f"Compare {QWEN_IMAGE} with {QWEN_IMAGE} and tell the difference.",
           "The quick brown fox jumps over the lazy dog"]


WRITERS = {"qwen2.5-vl": write_tiny_qwen25_vl, "qwen2-vl": write_tiny_qwen2_vl}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def qwen(request, tmp_path_factory) -> str:
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole-prompts", "chunks-of-16"])
def test_greedy_equals_transformers(qwen, chunk):
    engine = LLMEngine(model=qwen, dtype="float32", **({"max_num_batched_tokens": chunk} if chunk else {}))
    assert_mixed_batch_equals_transformers(qwen, PROMPTS, engine)


def test_chat_with_an_image(qwen):
    assert_chat_equals_transformers(qwen, LLMEngine(model=qwen, dtype="float32"))


def test_decode_steps_in_the_graphs_buffers_turn_by_the_shifted_positions(qwen):
    """Past its prompt a request with images decodes in the decode graphs (on CPU their static
    buffers, run eagerly), the positions buffer holding each token's index plus its images' shift:
    transformers' tokens, beside a text request decoding in the same steps."""
    engine = LLMEngine(model=qwen, dtype="float32", compile="off", attention_backend="torch")
    used = _with_static_decode(engine, max_seqs=4)
    assert_mixed_batch_equals_transformers(qwen, PROMPTS, engine)
    assert 3 in used  # the image requests decoded there, beside the text one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_tower_runs_there_and_decodes_replay_the_captured_graphs(qwen):
    """Section 6 of the issue: the vision tower on the GPU in the engine's process, the image
    embeddings entering through the (eager) prefill, the decode steps of requests with images
    replaying the captured graphs: transformers' tokens (float32 on the CPU)."""
    engine = LLMEngine(model=qwen, dtype="float32", **GPU_SHARE)
    graphs = engine.runner.graphs
    assert graphs is not None and engine.images is not None and engine.images.embedder.encoder.device.type == "cuda"
    replayed: list[int] = []
    run = graphs.run
    graphs.run = lambda batch: replayed.append(len(batch.seqs)) or run(batch)  # type: ignore[method-assign]
    assert_mixed_batch_equals_transformers(qwen, PROMPTS, engine)
    assert 3 in replayed
