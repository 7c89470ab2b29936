"""The routes a router asks of the replicas behind it (vLLM's router, SGLang's, the Gateway API
Inference Extension's endpoint picker), so that a pagedserve replica is one of their workers:

- `POST /v1/chat/completions/render`, `POST /v1/completions/render`: the request's prompt as
  token ids (`{"token_ids": [...]}`; with images, each image's tokens expanded and vLLM's
  `features`: their placeholder ranges and content hashes), which vLLM's router asks every worker
  before it places a request by prefix (cache_aware, kv_aware), and llm-d's endpoint picker asks
  for the blocks it matches against the workers' KV events;
- `POST /tokenize`: vLLM's tokenize route (`prompt` or `messages`), the router's fallback;
- `GET /get_load`: `{"load": N}`, the generation requests in flight here (power_of_two);
- `GET /metrics`: the Triton server's metrics, passed through, so a picker that scrapes the
  worker's own port reads vLLM's model-server gauges (`vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc`, ...) where it expects them.
"""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Annotated, Any, Callable

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from . import schemas, translate
from .config import GatewayConfig
from .errors import OpenAIError, unsupported
from .tokenize import PromptTokenizers

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The routes whose requests count in /get_load while they run."""

_DEFAULTS = {"add_special_tokens": True, "add_generation_prompt": True, "continue_final_message": False}
"""vLLM's tokenize options at the value the engine tokenizes with; another value is refused."""


class Load:
    """Generation requests in flight at this gateway (counted by the request guard)."""

    def __init__(self) -> None:
        self.in_flight = 0


def add_worker_routes(app: FastAPI, config: GatewayConfig, load: Load, tokenizers: PromptTokenizers,
                      triton_model: Callable[[str], str],
                      with_adapter: Callable[[list[translate.LLMRequest], str], None]) -> None:
    def tokenizer(model: str) -> Any:
        return tokenizers.get(app.state.triton, triton_model(model))

    async def chat(body: schemas.ChatCompletionRequest) -> translate.LLMRequest:
        llm_request = translate.chat_request(body, config.default_max_tokens, config.max_choices_per_request,
                                             config.tool_call_parser, reasoning_parser=config.reasoning_parser)
        with_adapter([llm_request], body.model)
        await llm_request.fetch_images(config)
        return llm_request

    def completion(body: schemas.CompletionRequest) -> translate.LLMRequest:
        requests = translate.completion_requests(body, config.default_max_tokens, config.max_choices_per_request)
        if len(requests) != 1:
            raise OpenAIError(400, "`prompt`: render takes one prompt", param="prompt")
        with_adapter(requests, body.model)
        return requests[0]

    def rendered(model: str, ids: list[int], features: dict[str, Any] | None) -> JSONResponse:
        return JSONResponse({"model": model, "token_ids": ids} | ({"features": features} if features else {}))

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: schemas.ChatCompletionRequest) -> JSONResponse:
        return rendered(body.model, *await tokenizer(body.model).render(await chat(body)))

    @app.post("/v1/completions/render")
    async def render_completion(body: schemas.CompletionRequest) -> JSONResponse:
        return rendered(body.model, *await tokenizer(body.model).render(completion(body)))

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> JSONResponse:
        for name, default in _DEFAULTS.items():
            if body.get(name, default) != default:
                raise unsupported(name, f"must be {str(default).lower()} here: the engine tokenizes prompts that way")
        fields = {k: v for k, v in body.items() if k not in _DEFAULTS}
        fields.setdefault("model", next(iter(config.model_ids())))
        if "messages" in fields:
            chat_body = _validated(schemas.ChatCompletionRequest, fields)
            ids, _ = await tokenizer(chat_body.model).render(await chat(chat_body))
        else:
            completion_body = _validated(schemas.CompletionRequest, fields)
            ids, _ = await tokenizer(completion_body.model).render(completion(completion_body))
        return JSONResponse({"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": None})

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        return JSONResponse({"load": load.in_flight})

    @app.get("/metrics")
    async def metrics() -> Response:
        url = f"http://{config.metrics_url()}/metrics"
        try:
            text = await asyncio.to_thread(_fetch, url)
        except OSError as error:
            raise OpenAIError(503, f"the Triton server's metrics at {url} did not answer ({error}); "
                                   "the gateway's --triton-metrics-url names them", code="service_unavailable") from None
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _validated(model: type[Any], fields: dict[str, Any]) -> Any:
    """`fields` as a request body of `model`; its errors as a typed body's, which the app's
    handler words (naming the field)."""
    from pydantic import ValidationError

    try:
        return model(**fields)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()
