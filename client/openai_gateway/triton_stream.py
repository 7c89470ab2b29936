"""The gateway's side of Triton: one gRPC stream per request to the `llm` model.

A stream that is closed before its final response (the HTTP client went away, the
handler was cancelled) cancels its gRPC call, which cancels the request in Triton and
frees its KV blocks in the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncGenerator

import grpc
import numpy as np

from ..client import infer_inputs, is_final
from .errors import OpenAIError, from_triton
from .translate import LLMRequest

log = logging.getLogger("pagedserve.openai")


@dataclass
class TokenLogprob:
    """A generated token, its logprob, and the `top` alternatives (token, logprob) by rank."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class SampleDelta:
    """What one response adds to one sample (choice)."""

    text: str
    finish_reason: str | None
    num_tokens: int
    logprobs: list[TokenLogprob] | None = None


@dataclass
class LLMStep:
    """One response of the `llm` model: a delta per sample, in sample order."""

    samples: list[SampleDelta]
    num_input_tokens: int
    final: bool


class TritonLLM:
    """The `llm` model over one gRPC channel (client.AsyncLLMClient), shared by every
    request of the gateway; Triton's errors as OpenAI errors."""

    def __init__(self, url: str):
        from ..client import AsyncLLMClient

        self.url = url
        self.llm = AsyncLLMClient(url)

    async def is_ready(self, model: str) -> bool:
        try:
            return await self.llm.client.is_server_ready() and await self.llm.client.is_model_ready(model)
        except Exception:  # noqa: BLE001 - unreachable or not serving: not ready, whatever the cause
            return False

    async def model_parameters(self, model: str) -> dict[str, str]:
        """The string parameters of a Triton model's configuration (config.pbtxt's)."""
        config = await self.llm.client.get_model_config(model, as_json=True)
        parameters = config.get("config", config).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in parameters.items()}

    async def stream(self, model: str, request: LLMRequest) -> AsyncGenerator[LLMStep, None]:
        from tritonclient.utils import InferenceServerException

        try:
            async with contextlib.aclosing(self.llm.results(infer_inputs(self.llm._module, request.inputs()), model)) as results:
                async for result in results:  # closing this generator early closes `results`, which cancels
                    yield parse_step(result, request.top_logprobs)
        except InferenceServerException as error:
            raise from_triton(error.message()) from None
        except grpc.RpcError as error:  # the address and details go to the log, not to the client
            log.warning("Triton at %s: %s: %s", self.url, error.code(), error.details())
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise OpenAIError(503, "the inference server is unavailable; retry later") from None
            raise OpenAIError(500, "the inference server failed the request (see the gateway's log)",
                              code="internal_error") from None

    async def close(self) -> None:
        await self.llm.close()


def parse_step(result: Any, top_logprobs: int | None) -> LLMStep:
    texts = _strings(result.as_numpy("text_output"))
    reasons = _strings(result.as_numpy("finish_reason"))
    counts = result.as_numpy("num_output_tokens")
    num_input = result.as_numpy("num_input_tokens")
    logprobs = _strings(result.as_numpy("logprobs")) if top_logprobs is not None else []
    samples = [
        SampleDelta(
            text=text,
            finish_reason=None if i >= len(reasons) or reasons[i] == "None" else reasons[i],
            num_tokens=int(counts[i]) if counts is not None and i < counts.size else 0,
            logprobs=_token_logprobs(logprobs[i], top_logprobs) if i < len(logprobs) else None,
        )
        for i, text in enumerate(texts)
    ]
    return LLMStep(samples, int(num_input[0]) if num_input is not None and num_input.size else 0, is_final(result))


def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def _token_logprobs(raw: str, top: int | None) -> list[TokenLogprob]:
    """vLLM-backend logprobs JSON: per token, {token_id: {logprob, rank, decoded_token}},
    the sampled token first, then the alternatives."""
    tokens = json.loads(raw) or []
    parsed = []
    for position in tokens:
        entries = list(position.values())
        sampled = entries[0]
        ranked = sorted((e for e in entries if e["rank"] <= (top or 0)), key=lambda e: e["rank"])
        parsed.append(TokenLogprob(
            token=sampled["decoded_token"],
            logprob=float(sampled["logprob"]),
            top=[(e["decoded_token"], float(e["logprob"])) for e in ranked],
        ))
    return parsed
