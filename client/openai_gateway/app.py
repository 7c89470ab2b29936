"""The gateway's HTTP routes (FastAPI): /v1/chat/completions, /v1/completions,
/v1/models, /health; those a router asks of its workers are in worker_routes.py.

Streaming answers are Server-Sent Events ending in `data: [DONE]`. A streamed request
waits for the server's first response before answering, so that a request the model
refuses gets its HTTP error status, not an error inside a 200 stream.

Guards (GatewayConfig's knobs): the API key, compared in constant time; the body read
whole before any route sees it, up to `max_body_bytes` and within `body_timeout_s`;
prompts x `n` up to `max_choices_per_request`; a deadline of `request_timeout_s` on
every request to Triton. A failure of the gateway itself is a 500 `internal_error`,
never blamed on the request. The connection limits are the server's (server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import responses, schemas, translate
from .config import GatewayConfig, knob
from .errors import OpenAIError
from .tokenize import PromptTokenizers
from .triton_stream import LLMStep, TritonLLM
from .worker_routes import GENERATION_PATHS, Load, add_worker_routes

DISCONNECT_POLL_S = 0.25
HEALTH_PATHS = ("/health", "/health/ready")
OPEN_PATHS = frozenset({*HEALTH_PATHS, "/metrics", "/get_load"})
"""The routes that need no API key: health, and the load figures routers and scrapers poll."""

log = logging.getLogger("pagedserve.openai")


def create_app(config: GatewayConfig, triton: TritonLLM | None = None) -> FastAPI:
    model_ids = config.model_ids()
    adapters = config.adapters()
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.triton = triton or TritonLLM(config.triton_url)
        preload = asyncio.create_task(tokenizers.preload(app.state.triton, set(model_ids.values())))
        yield
        preload.cancel()
        await app.state.triton.close()

    # no /docs, /redoc, /openapi.json: the API is OpenAI's, and nothing is served that need not be
    app = FastAPI(title="pagedserve OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    load = Load()
    tokenizers = PromptTokenizers(config.tokenizer)
    app.add_middleware(RequestGuard, config=config, load=load)

    def triton_model(model: str) -> str:
        if model not in model_ids:
            raise OpenAIError(404, f"The model `{model}` does not exist. Served: {sorted(model_ids)}", param="model",
                              code="model_not_found")
        return model_ids[model]

    def with_adapter(requests: list[translate.LLMRequest], model: str) -> None:
        """A request for an adapter's model id runs with that adapter (its `lora_name`)."""
        if model in adapters:
            for llm_request in requests:
                llm_request.sampling["lora_name"] = adapters[model][1]

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        """Starlette's own refusals (a body it cannot parse, a wrong method) in OpenAI's error shape."""
        return JSONResponse(OpenAIError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return JSONResponse(OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}").body(), status_code=400)
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if param is None:  # the body as a whole: missing, or not an object
            message = f"the body must be a JSON object ({first.get('msg')})"
            return JSONResponse(OpenAIError(400, message).body(), status_code=400)
        return JSONResponse(OpenAIError(400, f"`{param}`: {first.get('msg')}", param=param).body(), status_code=400)

    @app.get(HEALTH_PATHS[0])
    @app.get(HEALTH_PATHS[1])  # the route of Triton's own OpenAI frontend
    async def health() -> Response:
        """Ready or not, and nothing else: it needs no key, so it names no address or model."""
        ready = [await app.state.triton.is_ready(name) for name in model_ids.values()]
        status = 200 if all(ready) else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable"}, status_code=status)

    def bounded(streams: list[AsyncGenerator[LLMStep, None]]) -> AsyncGenerator[tuple[int, LLMStep], None]:
        """The streams merged, under the request's deadline (from now)."""
        deadline = asyncio.get_running_loop().time() + config.request_timeout_s
        return within(merged(streams), deadline, config.request_timeout_s)

    async def card(name: str) -> schemas.ModelCard:
        takes_images = await tokenizers.get(app.state.triton, triton_model(name)).takes_images()
        modalities = None if takes_images is None else ["text", "image"] if takes_images else ["text"]
        return schemas.ModelCard(id=name, created=started, input_modalities=modalities)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [await card(name) for name in model_ids]
        return JSONResponse(schemas.ModelList(data=cards).model_dump(exclude_none=True))

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        return JSONResponse((await card(model)).model_dump(exclude_none=True))

    @app.post("/v1/chat/completions")
    async def chat(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        model = triton_model(body.model)
        llm_request = translate.chat_request(body, config.default_max_tokens, config.max_choices_per_request,
                                             config.tool_call_parser, model_defaults=config.generation_config == "auto",
                                             reasoning_parser=config.reasoning_parser)
        with_adapter([llm_request], body.model)
        await llm_request.fetch_images(config)
        header = responses.ResponseHeader.new("chatcmpl", body.model)
        result = responses.Accumulator(n=body.n)
        steps = bounded([app.state.triton.stream(model, llm_request)])
        if not body.stream:
            await until_disconnect(request, collect(steps, result))
            return JSONResponse(responses.chat_completion(header, result, llm_request.reply()).model_dump())
        plan = llm_request.reply()
        replies = responses.StreamedReplies(plan) if plan is not None else None

        async def chunks(first: tuple[int, LLMStep] | None) -> AsyncIterator[BaseModel]:
            if first is not None:  # the role chunk's running usage has the prompt (vLLM's does)
                result.count_prompt(first[1])
            yield with_usage(responses.chat_role_chunk(header, body.n), result, body.continuous_usage)
            async for _, step in prepend(first, steps):
                result.add(step)
                for chunk in responses.chat_chunks(header, step, replies):
                    yield with_usage(chunk, result, body.continuous_usage)
            if body.include_usage:
                yield responses.usage_chunk(header, result, chat=True)

        return await sse(steps, chunks)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        model = triton_model(body.model)
        llm_requests = translate.completion_requests(body, config.default_max_tokens, config.max_choices_per_request,
                                                     model_defaults=config.generation_config == "auto")
        with_adapter(llm_requests, body.model)
        prompts = [r.text or "" for r in llm_requests]
        header = responses.ResponseHeader.new("cmpl", body.model)
        result = responses.Accumulator(n=body.n)
        steps = bounded([app.state.triton.stream(model, r) for r in llm_requests])
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

    add_worker_routes(app, config, load, tokenizers, triton_model, with_adapter)
    return app


def with_usage(chunk: schemas.ResponseFields, result: responses.Accumulator, continuous: bool) -> BaseModel:
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


async def sse(steps: AsyncGenerator[Any, None], chunks: Callable[[Any], AsyncIterator[BaseModel]]) -> StreamingResponse:
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
        except Exception:  # the gateway's own failure: logged, reported as internal
            log.exception("internal error in a streamed response")
            yield f"data: {json.dumps(internal_error().body())}\n\n"
        finally:
            await steps.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def within(steps: AsyncGenerator[Any, None], deadline: float, timeout_s: float) -> AsyncGenerator[Any, None]:
    """`steps` until the loop's clock reaches `deadline`; then they are closed (which
    cancels their Triton requests) and a 504 naming `request_timeout_s` is raised."""
    try:
        while True:
            timer = asyncio.timeout_at(deadline)
            try:
                async with timer:
                    item = await steps.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not timer.expired():
                    raise
                raise OpenAIError(504, f"the request ran past its deadline of {timeout_s:g} s "
                                       f"({knob('request_timeout_s')}) and was cancelled", code="timeout") from None
            yield item
    finally:
        await steps.aclose()


def internal_error() -> OpenAIError:
    return OpenAIError(500, "internal error in the gateway (its log has the details)", code="internal_error")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class RequestGuard:
    """ASGI middleware, in front of every route: checks the API key (every route but
    OPEN_PATHS; before any of the body is read), counts the generation requests in flight,
    reads the body whole before the app sees it, at most `max_body_bytes` (413 past it,
    naming the knob; a declared Content-Length past it is refused unread) and within
    `body_timeout_s` of the headers (408); and
    turns any exception that escapes the app into an OpenAI-shaped 500 `internal_error`."""

    def __init__(self, app: Any, config: GatewayConfig, load: Load | None = None):
        self.app = app
        self.load = load or Load()
        self.max_body_bytes = config.max_body_bytes
        self.body_timeout_s = config.body_timeout_s
        self.key_digest = _digest(config.api_key.encode("ascii")) if config.api_key else None

    def authorized(self, scope: dict) -> bool:
        if self.key_digest is None or scope["path"] in OPEN_PATHS:
            return True
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, presented = header.partition(b" ")
        # digests of equal length, compared in constant time: neither the key nor its length leaks
        return hmac.compare_digest(_digest(presented.strip()), self.key_digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.authorized(scope):
            return await _send_error(send, OpenAIError(
                401, "Incorrect or missing API key (send `Authorization: Bearer <key>`)", code="invalid_api_key"))
        too_large = OpenAIError(413, f"the request body is larger than {self.max_body_bytes} bytes "
                                     f"({knob('max_body_bytes')})", code="request_too_large")
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared and declared[0].isdigit() and int(declared[0]) > self.max_body_bytes:
            return await _send_error(send, too_large)
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left before its request was whole
                    body += message.get("body", b"")
                    if len(body) > self.max_body_bytes:
                        return await _send_error(send, too_large)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await _send_error(send, OpenAIError(
                408, f"the request body did not arrive within {self.body_timeout_s:g} s ({knob('body_timeout_s')})",
                code="timeout"))
        whole: dict | None = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay() -> dict:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # then what the server says next (a disconnect)

        started = False

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        counted = scope["path"] in GENERATION_PATHS
        self.load.in_flight += counted
        try:
            await self.app(scope, replay, watched_send)
        except Exception:  # reported as the gateway's fault, never the client's
            log.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await _send_error(send, internal_error())
        finally:
            self.load.in_flight -= counted


async def _send_error(send: Callable, error: OpenAIError) -> None:
    """An OpenAI error response that also closes the connection (whatever of the request
    was left unread is not read)."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def merged(streams: list[AsyncGenerator[LLMStep, None]]) -> AsyncGenerator[tuple[int, LLMStep], None]:
    """(stream index, step) from several streams as they arrive; closing this closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for step in stream:
                yield 0, step
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[LLMStep]) -> None:
        try:
            async for step in stream:
                await queue.put((index, step))
            await queue.put((index, done))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
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
