"""`pagedserve openai`: an OpenAI-compatible HTTP API in front of a running tritonserver.

It speaks to Triton over gRPC streaming (one stream per request), so it works beside
any Triton deployment, local or remote, and scales on its own. Modules: schemas
(request/response bodies), translate (OpenAI fields -> `llm` inputs), triton_stream
(the gRPC side), responses (OpenAI bodies and chunks), app (routes), config.
"""

from __future__ import annotations

from .config import GatewayConfig, GatewayConfigError

__all__ = ["GatewayConfig", "GatewayConfigError", "create_app", "run_gateway"]


def create_app(config: GatewayConfig):
    from .app import create_app as _create_app

    return _create_app(config)


def run_gateway(config: GatewayConfig) -> None:
    """Serve until interrupted (uvicorn, one process)."""
    import uvicorn

    print(
        f"pagedserve OpenAI API on http://{config.host}:{config.port}/v1 -> Triton gRPC {config.triton_url}, "
        f"models {sorted(config.model_ids())}{' (API key required)' if config.api_key else ''}",
        flush=True,
    )
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
