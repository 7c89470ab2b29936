"""How requests reach the server: the `llm` model over gRPC streaming
(tritonclient.grpc.aio, one stream per request), over HTTP `generate_stream`
(server-sent events, aiohttp; the naive baseline server speaks only this), or an
OpenAI-compatible `/v1/completions` (`pagedserve openai`, vLLM's server; SSE, aiohttp).

All turn a streamed response into :class:`StreamChunk` (token counts), all the
runner needs, so the timing code is the same whichever protocol is measured.
Client libraries are imported when a transport is made, not with this module.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from .config import BenchConfig
from .workloads import RequestSpec


@dataclass
class StreamChunk:
    """One streamed response as the load generator needs it."""

    num_tokens: int
    prompt_tokens: int | None = None


class ServerError(RuntimeError):
    """The server answered the request with an error."""


class Transport(Protocol):
    """Streams one request's responses; raises :class:`ServerError` (or a client error) on failure."""

    def stream(self, spec: RequestSpec, sampling: dict[str, Any]) -> AsyncIterator[StreamChunk]: ...

    async def close(self) -> None: ...


COUNTS = ("return_num_input_tokens", "return_num_output_tokens")


def request_values(spec: RequestSpec, sampling: dict[str, Any]) -> dict[str, Any]:
    """The `llm` inputs of one request, the same over gRPC and HTTP: only the outputs the
    load generator counts with (the counts; the text is not read, the final response is
    Triton's `triton_final_response` flag), so neither protocol pays for others."""
    from ..client import llm_values

    return llm_values(spec.prompt, returns=COUNTS, **sampling)


class GrpcTransport:
    """`llm` over tritonclient.grpc.aio: one bidirectional stream per request.

    After the final response the stream is drained to its natural end (the request
    iterator has already half-closed it) rather than cancelled: a finished request
    needs no cancellation, and the server should see a plain close."""

    def __init__(self, url: str, model: str, timeout: float | None = None):
        import tritonclient.grpc.aio as aioclient

        self._module = aioclient
        self.client = aioclient.InferenceServerClient(url)
        self.model = model
        self.timeout = timeout

    async def stream(self, spec: RequestSpec, sampling: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        from ..client import infer_inputs, is_final, output_count

        inputs = infer_inputs(self._module, request_values(spec, sampling))

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        responses = self.client.stream_infer(requests(), stream_timeout=self.timeout)
        final = False
        try:
            async for result, error in responses:
                if final:
                    continue  # draining: nothing more is expected
                if error is not None:
                    raise ServerError(str(error))
                yield StreamChunk(output_count(result, "num_output_tokens") or 0, output_count(result, "num_input_tokens"))
                final = is_final(result)
            if not final:
                raise ServerError("the stream ended without a final response")
        except BaseException:
            if not final:
                responses.cancel()  # give up on the request (error, timeout, or the run was stopped)
            raise

    async def close(self) -> None:
        await self.client.close()


class HttpTransport:
    """Triton's `POST /v2/models/<model>/generate_stream` (SSE); the naive baseline
    server speaks the same. Responses without `num_output_tokens` count as one token
    when they carry text."""

    def __init__(self, url: str, model: str, timeout: float | None = None):
        import aiohttp

        base = url if url.startswith(("http://", "https://")) else f"http://{url}"
        self.endpoint = f"{base.rstrip('/')}/v2/models/{model}/generate_stream"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # open loop may have many requests in flight
            timeout=aiohttp.ClientTimeout(total=timeout),
        )

    async def stream(self, spec: RequestSpec, sampling: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        async for event in self.events(request_values(spec, sampling)):
            if "num_output_tokens" in event:
                tokens = int(event["num_output_tokens"] or 0)
            else:
                tokens = 1 if event.get("text_output") else 0
            prompt_tokens = event.get("num_input_tokens")
            yield StreamChunk(tokens, int(prompt_tokens) if isinstance(prompt_tokens, (int, float)) else None)

    async def events(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON events of a POSTed SSE stream (`data: [DONE]` ends it); errors raised."""
        async with self.session.post(self.endpoint, json=body) as response:
            if response.status != 200:
                text = await response.text()
                raise ServerError(f"HTTP {response.status}: {_event_error(text) or text.strip()[:300]}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ServerError(str(event["error"]))
                yield event

    async def close(self) -> None:
        await self.session.close()


class OpenAITransport(HttpTransport):
    """`POST /v1/completions`, streamed. A chunk with text counts the tokens its running
    usage adds (`stream_options.continuous_usage_stats`, vLLM's: exact also when a chunk
    gathers several tokens, `--stream-interval`), or one token where a server sends no
    running usage; the usage chunk at the end (`include_usage`) brings the exact total,
    any difference is added to the last chunk's count. $OPENAI_API_KEY, when set, is
    sent as the bearer key."""

    def __init__(self, url: str, model: str, timeout: float | None = None):
        super().__init__(url, model, timeout)
        if os.environ.get("OPENAI_API_KEY"):
            self.session.headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        base = url if url.startswith(("http://", "https://")) else f"http://{url}"
        self.endpoint = f"{base.rstrip('/')}/v1/completions"
        self.model = model

    async def stream(self, spec: RequestSpec, sampling: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        body = {"model": self.model, "prompt": spec.prompt, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}} | sampling
        counted = 0
        async for event in self.events(body):
            usage = event.get("usage")
            if any(choice.get("text") for choice in event.get("choices", ())):
                tokens = max(1, usage["completion_tokens"] - counted) if usage else 1
                counted += tokens
                yield StreamChunk(tokens, usage["prompt_tokens"] if usage else None)
            elif usage and not event.get("choices"):  # the closing usage chunk
                yield StreamChunk(max(0, usage["completion_tokens"] - counted), usage["prompt_tokens"])


def _event_error(text: str) -> str | None:
    """The error message of an SSE or JSON error body, if it is one."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:]
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            return str(event["error"])
    return None


def make_transport(config: BenchConfig) -> Transport:
    """Call inside the running event loop (aiohttp binds its session to it)."""
    if config.protocol == "openai":
        return OpenAITransport(config.url, config.model_name, config.request_timeout)
    if config.protocol == "http":
        return HttpTransport(config.url, config.model_name, config.request_timeout)
    return GrpcTransport(config.url, config.model_name)
