"""gRPC streaming through the `llm` ensemble, as users call it."""

from __future__ import annotations

import pytest

from pagedserve.backend import SamplingParams
from pagedserve.client.client import LLMClient

from .conftest import llm_inputs, stream_request, texts

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_streamed_deltas_equal_the_non_streamed_text_and_the_engine(server, engine):
    prompt = "The three primary colors are"
    streamed, error = stream_request(server, llm_inputs(prompt, max_tokens=40, temperature=0))
    assert error is None and len(streamed) > 5
    whole, error = stream_request(server, llm_inputs(prompt, stream=False, exclude_input_in_output=None, max_tokens=40, temperature=0) )
    assert error is None and len(whole) == 1
    [offline] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    assert "".join(texts(streamed)) == offline.text
    assert texts(whole)[0] == prompt + offline.text  # vLLM contract: prompt prepended unless excluded


def test_chat_messages_answer_paris(server):
    assert LLMClient(server.grpc_url).generate(messages=CAPITAL, max_tokens=30, temperature=0) == "The capital of France is Paris."


def test_a_chat_after_others_sharing_its_system_prompt_answers_as_alone(server):
    """Issue 43's requests: the chat template's system prompt is in the prefix cache after the
    first, so the later chats prefill only their own tokens after cached blocks. Their answers
    are the ones a whole prompt gives (float32: the top two first tokens, "The" and "L", are
    0.08 apart in the reference, far beyond float32 rounding)."""
    client = LLMClient(server.grpc_url)

    def ask(country: str) -> str:
        return client.generate(messages=[{"role": "user", "content": f"What is the capital of {country}?"}],
                               max_tokens=20, temperature=0)

    first, _, again = ask("France"), ask("Italy"), ask("France")
    assert first == again == "The capital of France is Paris."


@pytest.mark.parametrize("question", ["Translate to Japanese: good morning", "Write 'cat' in Japanese."])
def test_cjk_answers_stream_without_replacement_characters(server, engine, question):
    chunks = list(LLMClient(server.grpc_url).stream(messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0))
    text = "".join(c.text for c in chunks)
    assert any(ord(ch) > 0x3000 for ch in text)
    assert not any("\ufffd" in c.text for c in chunks)
    [offline] = engine.generate([engine.encode(messages=[{"role": "user", "content": question}])], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    assert text == offline.text


def test_finish_reason_is_none_until_the_last_response(server):
    results, error = stream_request(server, llm_inputs("Count: one, two,", max_tokens=6, temperature=0) + [])
    assert error is None
    chunks = list(LLMClient(server.grpc_url).stream("Count: one, two,", max_tokens=6, temperature=0))
    assert [c.finish_reason for c in chunks[:-1]] == ["None"] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length" and chunks[-1].final
    assert sum(c.num_output_tokens for c in chunks) == 6


def test_stop_string_is_trimmed_in_the_stream(server):
    text = LLMClient(server.grpc_url).generate(messages=CAPITAL, max_tokens=30, temperature=0, stop=["is P"])
    assert text == "The capital of France "


def test_the_asyncio_client_streams_the_same_text_as_the_blocking_one(server):
    import asyncio

    from pagedserve.client.client import AsyncLLMClient

    async def streamed() -> list:
        client = AsyncLLMClient(server.grpc_url)
        try:
            return [chunk async for chunk in client.stream("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)]
        finally:
            await client.close()

    chunks = asyncio.run(streamed())
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert sum(c.num_output_tokens for c in chunks) == 8
    assert "".join(c.text for c in chunks) == LLMClient(server.grpc_url).generate(
        "Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)


def test_a_requests_stream_interval_gathers_tokens_into_fewer_responses(server):
    every = list(LLMClient(server.grpc_url).stream("Count: one, two,", max_tokens=10, temperature=0, ignore_eos=True))
    gathered = list(LLMClient(server.grpc_url).stream("Count: one, two,", max_tokens=10, temperature=0, ignore_eos=True,
                                                      stream_interval=4))
    assert [c.num_output_tokens for c in every] == [1] * 10
    assert [c.num_output_tokens for c in gathered] == [1, 4, 4, 1] and gathered[-1].final
    assert "".join(c.text for c in gathered) == "".join(c.text for c in every)
