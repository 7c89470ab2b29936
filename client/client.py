"""A small client for the `llm` model over tritonclient gRPC streaming (sync and asyncio)."""

from __future__ import annotations

import contextlib
import json
import queue
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Iterator

import numpy as np


@dataclass
class Chunk:
    """One streamed response: a text delta, with the finish reason on the last one."""

    text: str
    finish_reason: str | None = None
    num_output_tokens: int = 0
    final: bool = False


DEFAULT_RETURNS = ("return_finish_reason", "return_num_output_tokens")
"""The return_* flags this client's Chunk reads."""

USE_MODEL_DEFAULTS = "use_model_defaults"
"""`llm`'s one sampling key beyond vLLM's: true fills the sampling fields a request leaves out from
the served model's recommendation (its generation_config.json; the bundled model's card), as vLLM's
OpenAI server does. Without it `llm` keeps vLLM's own defaults (temperature 1.0), as Triton's vLLM
backend does."""


def llm_values(
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    stream: bool = True,
    returns: tuple[str, ...] = DEFAULT_RETURNS,
    model_defaults: bool = False,
    **sampling: Any,
) -> dict[str, Any]:
    """`llm`'s inputs as Python values in the Triton vLLM-backend style (the same over gRPC
    and HTTP): the prompt as text or chat messages, the return_* flags named in `returns`
    set, the sampling parameters as JSON (None ones left out; `model_defaults`: the served
    model's recommended sampling fills the fields left out, USE_MODEL_DEFAULTS)."""
    values: dict[str, Any] = {"messages": json.dumps(messages)} if messages is not None else {"text_input": prompt or ""}
    values |= {"stream": stream, "exclude_input_in_output": True}
    values |= {flag: True for flag in returns}
    chosen = {k: v for k, v in sampling.items() if v is not None}
    if model_defaults:
        chosen[USE_MODEL_DEFAULTS] = True
    values["sampling_parameters"] = json.dumps(chosen)
    return values


def build_inputs(
    module: Any,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    stream: bool = True,
    returns: tuple[str, ...] = DEFAULT_RETURNS,
    model_defaults: bool = False,
    **sampling: Any,
) -> list[Any]:
    """llm_values as InferInputs; `module` is tritonclient.grpc, .grpc.aio or .http."""
    return infer_inputs(module, llm_values(prompt, messages, stream, returns, model_defaults, **sampling))


def as_messages(prompt: str | None, messages: list[dict[str, str]] | None,
                chat_template: bool) -> list[dict[str, str]] | None:
    """The request's chat messages: `messages` as given, or with `chat_template` the prompt as one
    user message (the server renders the model's chat template); None for a raw prompt."""
    if messages is not None:
        if chat_template:
            raise ValueError("chat_template wraps a prompt: pass a prompt or messages, not both")
        return messages
    if chat_template:
        if prompt is None:
            raise ValueError("chat_template needs a prompt to wrap as a user message")
        return [{"role": "user", "content": prompt}]
    return None


def infer_inputs(module: Any, values: dict[str, Any]) -> list[Any]:
    """InferInputs of shape [1] from Python values (str -> BYTES, bool -> BOOL, int -> INT32,
    float -> FP32), of shape [N] from a list of N str (BYTES: `image`'s base64 files); `module` is
    tritonclient.grpc, .grpc.aio or .http."""
    inputs = []
    for name, value in values.items():
        if isinstance(value, list):
            array = np.array([v.encode("utf-8") for v in value], dtype=np.object_)
            tensor = module.InferInput(name, [len(value)], "BYTES")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
            continue
        if isinstance(value, str):
            array, dtype = np.array([value.encode("utf-8")], dtype=np.object_), "BYTES"
        elif isinstance(value, bool):
            array, dtype = np.array([value]), "BOOL"
        elif isinstance(value, int):
            array, dtype = np.array([value], dtype=np.int32), "INT32"
        else:
            array, dtype = np.array([value], dtype=np.float32), "FP32"
        tensor = module.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def output_count(result: Any, name: str) -> int | None:
    """A count output (`num_output_tokens`, `num_input_tokens`) summed over its samples;
    None when the response does not carry it."""
    count = result.as_numpy(name)
    return int(count.sum()) if count is not None and count.size else None


def parse_result(result: Any) -> Chunk:
    text = result.as_numpy("text_output")
    reason = result.as_numpy("finish_reason")
    return Chunk(
        text="".join(t.decode("utf-8") for t in text) if text is not None else "",
        finish_reason=(reason[0].decode() if reason is not None and reason.size else None),
        num_output_tokens=output_count(result, "num_output_tokens") or 0,
        final=is_final(result),
    )


def is_final(result: Any) -> bool:
    """Whether a streamed result is its request's last (Triton's `triton_final_response`)."""
    parameters = result.get_response().parameters
    return "triton_final_response" in parameters and bool(parameters["triton_final_response"].bool_param)


def chunk_or_raise(result: Any, error: Exception | None) -> Chunk:
    """One stream callback's outcome: its chunk, or the server's error raised."""
    if error is not None:
        raise error
    return parse_result(result)


class LLMClient:
    """Blocking client: `stream()` yields Chunks as tokens arrive; `generate()` returns the text.

    An instruct model wants its chat template: give `messages`, or a prompt with
    `chat_template=True`. Sampling fields a call leaves out take the served model's recommended
    values (`model_defaults`, on by default, as with vLLM's OpenAI server: the bundled model samples
    at temperature 0.2, top_p 0.9); `model_defaults=False` gives vLLM's own defaults (temperature
    1.0), what the `llm` model applies to a request that does not ask for the model's."""

    def __init__(self, url: str = "localhost:8001", model: str = "llm", model_defaults: bool = True):
        self.url = url
        self.model = model
        self.model_defaults = model_defaults

    def stream(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None, *,
               chat_template: bool = False, **sampling: Any) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient

        inputs = build_inputs(grpcclient, prompt, as_messages(prompt, messages, chat_template), stream=True,
                              model_defaults=self.model_defaults, **sampling)

        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        answered = False
        try:
            client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex)
            while True:
                chunk = chunk_or_raise(*results.get())
                answered = chunk.final
                yield chunk
                if chunk.final:
                    return
        finally:
            # Cancel only a request left unfinished: tritonserver 2.51's gRPC frontend can keep the
            # model referenced (and its unload waits out the exit timeout) when a stream whose
            # request was just answered is cancelled.
            client.stop_stream(cancel_requests=not answered)
            client.close()

    def generate(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None, *,
                 chat_template: bool = False, **sampling: Any) -> str:
        return "".join(chunk.text for chunk in self.stream(prompt, messages, chat_template=chat_template, **sampling))


class AsyncLLMClient:
    """asyncio client over tritonclient.grpc.aio; one gRPC stream per request. `chat_template` and
    `model_defaults` as LLMClient's."""

    def __init__(self, url: str = "localhost:8001", model: str = "llm", model_defaults: bool = True):
        import tritonclient.grpc.aio as aioclient

        self._module = aioclient
        self.client = aioclient.InferenceServerClient(url)
        self.model = model
        self.model_defaults = model_defaults

    async def stream(
        self, prompt: str | None = None, messages: list[dict[str, str]] | None = None, *,
        chat_template: bool = False, **sampling: Any
    ) -> AsyncIterator[Chunk]:
        inputs = build_inputs(self._module, prompt, as_messages(prompt, messages, chat_template), stream=True,
                              model_defaults=self.model_defaults, **sampling)
        async with contextlib.aclosing(self.results(inputs)) as results:
            async for result in results:
                yield parse_result(result)

    async def results(self, inputs: list[Any], model: str | None = None) -> AsyncGenerator[Any, None]:
        """The raw results of one request on a gRPC stream of its own, up to the final one.

        The server's error is raised (InferenceServerException), as is a stream that ends
        without a final result; closing this early cancels the request in the server."""
        from tritonclient.utils import InferenceServerException

        model = model or self.model

        async def one_request():
            yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        call = self.client.stream_infer(one_request())
        final = False
        try:
            async for result, error in call:
                if error is not None:
                    raise error
                final = is_final(result)
                yield result
                if final:
                    return
            raise InferenceServerException(f"the `{model}` model ended its stream without a final response")
        finally:
            if not final:
                call.cancel()

    async def generate(self, prompt: str | None = None, messages: list[dict[str, str]] | None = None, *,
                       chat_template: bool = False, **sampling: Any) -> str:
        return "".join([chunk.text async for chunk in self.stream(prompt, messages, chat_template=chat_template,
                                                                  **sampling)])

    async def close(self) -> None:
        await self.client.close()
