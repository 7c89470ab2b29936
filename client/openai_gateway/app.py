"""The gateway's HTTP routes (FastAPI): /v1/chat/completions, /v1/completions,
/v1/models, /health.

Streaming answers are Server-Sent Events ending in `data: [DONE]`. A streamed request
waits for the server's first response before answering, so that a request the model
refuses gets its HTTP error status, not an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from . import responses, schemas, translate
from .config import GatewayConfig
from .errors import OpenAIError
from .triton_stream import LLMStep, TritonLLM

DISCONNECT_POLL_S = 0.25


def create_app(config: GatewayConfig, triton: TritonLLM | None = None) -> FastAPI:
    model_ids = config.model_ids()
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.triton = triton or TritonLLM(config.triton_url)
        yield
        await app.state.triton.close()

    app = FastAPI(title="pagedserve OpenAI-compatible API", lifespan=lifespan)

    def check_key(request: Request) -> None:
        if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise OpenAIError(401, "Incorrect or missing API key (send `Authorization: Bearer <key>`)", code="invalid_api_key")

    def triton_model(model: str) -> str:
        if model not in model_ids:
            raise OpenAIError(404, f"The model `{model}` does not exist. Served: {sorted(model_ids)}", param="model",
                              code="model_not_found")
        return model_ids[model]

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return JSONResponse(OpenAIError(400, f"`{param}`: {first.get('msg')}", param=param).body(), status_code=400)

    @app.get("/health")
    @app.get("/health/ready")  # the route of Triton's own OpenAI frontend
    async def health() -> Response:
        ready = [await app.state.triton.is_ready(name) for name in model_ids.values()]
        status = 200 if all(ready) else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable", "triton_url": config.triton_url},
                            status_code=status)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def list_models() -> schemas.ModelList:
        return schemas.ModelList(data=[schemas.ModelCard(id=name, created=started) for name in model_ids])

    @app.get("/v1/models/{model:path}", dependencies=[Depends(check_key)])
    async def get_model(model: str) -> schemas.ModelCard:
        triton_model(model)
        return schemas.ModelCard(id=model, created=started)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        model = triton_model(body.model)
        llm_request = translate.chat_request(body, config.default_max_tokens)
        header = responses.ResponseHeader.new("chatcmpl", body.model)
        result = responses.Accumulator(n=body.n)
        steps = merged([app.state.triton.stream(model, llm_request)])
        if not body.stream:
            await until_disconnect(request, collect(steps, result))
            return JSONResponse(responses.chat_completion(header, result).model_dump())

        async def chunks(first: tuple[int, LLMStep] | None) -> AsyncIterator[BaseModel]:
            if first is not None:  # the role chunk's running usage has the prompt (vLLM's does)
                result.count_prompt(first[1])
            yield with_usage(responses.chat_role_chunk(header, body.n), result, body.continuous_usage)
            async for _, step in prepend(first, steps):
                result.add(step)
                for chunk in responses.chat_chunks(header, step):
                    yield with_usage(chunk, result, body.continuous_usage)
            if body.include_usage:
                yield responses.usage_chunk(header, result, chat=True)

        return await sse(steps, chunks)

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        model = triton_model(body.model)
        llm_requests = translate.completion_requests(body, config.default_max_tokens)
        prompts = [r.text or "" for r in llm_requests]
        header = responses.ResponseHeader.new("cmpl", body.model)
        result = responses.Accumulator(n=body.n)
        steps = merged([app.state.triton.stream(model, r) for r in llm_requests])
        if not body.stream:
            await until_disconnect(request, collect(steps, result))
            return JSONResponse(responses.completion(header, result, prompts, body.echo).model_dump())

        async def chunks(first: tuple[int, LLMStep] | None) -> AsyncIterator[BaseModel]:
            echoed: set[int] = set()
            async for index, step in prepend(first, steps):
                if body.echo and index not in echoed:
                    echoed.add(index)
                    yield schemas.Completion(**header.fields(), choices=[
                        schemas.CompletionChoice(index=index * body.n + i, text=prompts[index]) for i in range(body.n)
                    ])
                result.add(step, index)
                for chunk in responses.completion_chunks(header, step, index * body.n):
                    yield with_usage(chunk, result, body.continuous_usage)
            if body.include_usage:
                yield responses.usage_chunk(header, result, chat=False)

        return await sse(steps, chunks)

    return app


def with_usage(chunk: BaseModel, result: responses.Accumulator, continuous: bool) -> BaseModel:
    """The chunk, with the usage so far where the client asked for it in every chunk."""
    if continuous:
        chunk.usage = result.usage()
    return chunk


async def collect(steps: AsyncIterator[tuple[int, LLMStep]], result: responses.Accumulator) -> None:
    async for index, step in steps:
        result.add(step, index)


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; cancel it (and so its Triton requests) if the HTTP client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise OpenAIError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def sse(steps: AsyncIterator[Any], chunks: Callable[[Any], AsyncIterator[BaseModel]]) -> StreamingResponse:
    """A Server-Sent Events response; the first response is awaited here so that an
    error before it (a refused request) is an HTTP error status."""
    try:
        first = await steps.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await steps.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks(first):
                yield f"data: {chunk.model_dump_json()}\n\n"
        except OpenAIError as error:  # after the 200 went out: OpenAI's in-stream error event
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            await steps.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def merged(streams: list[AsyncIterator[LLMStep]]) -> AsyncIterator[tuple[int, LLMStep]]:
    """(stream index, step) from several streams as they arrive; closing this closes them all."""
    if len(streams) == 1:
        async for step in streams[0]:
            yield 0, step
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[LLMStep]) -> None:
        try:
            async for step in stream:
                await queue.put((index, step))
            await queue.put((index, done))
        except BaseException as error:  # handed to the consumer, which re-raises it
            await queue.put((index, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
