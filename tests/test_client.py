"""client/client.py without a server: what LLMClient puts in `llm`'s inputs."""

from __future__ import annotations

import json

import pytest

from pagedserve.client.client import USE_MODEL_DEFAULTS, as_messages, llm_values


def sampling(values: dict) -> dict:
    return json.loads(values["sampling_parameters"])


def test_model_defaults_ask_for_the_models_recommended_sampling_and_keep_what_is_set():
    """LLMClient's requests carry `use_model_defaults` (the served model's recommendation fills what they
    leave out); without it `llm` keeps vLLM's defaults, the vLLM backend's contract."""
    asked = sampling(llm_values("Hi", model_defaults=True, temperature=0.0, top_p=None))
    assert asked == {USE_MODEL_DEFAULTS: True, "temperature": 0.0}
    assert USE_MODEL_DEFAULTS not in sampling(llm_values("Hi", max_tokens=4))


def test_chat_template_wraps_the_prompt_as_one_user_message():
    assert as_messages("What is the capital of France?", None, chat_template=True) == [
        {"role": "user", "content": "What is the capital of France?"}]
    assert as_messages("Once upon a time", None, chat_template=False) is None
    chat = [{"role": "user", "content": "Hi"}]
    assert as_messages(None, chat, chat_template=False) is chat
    with pytest.raises(ValueError, match="not both"):
        as_messages("Hi", chat, chat_template=True)
    with pytest.raises(ValueError, match="needs a prompt"):
        as_messages(None, None, chat_template=True)
