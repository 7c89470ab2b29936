"""`pagedserve openai`: an OpenAI-compatible HTTP API in front of a running tritonserver.

It speaks to Triton over gRPC streaming (one stream per request), so it works beside
any Triton deployment, local or remote, and scales on its own. Modules: schemas
(request/response bodies), translate (OpenAI fields -> `llm` inputs), triton_stream
(the gRPC side), responses (OpenAI bodies and chunks), app (routes and request guards),
server (uvicorn and its connection limits), config (the one validated set of settings:
loopback unless a key is set, the key, every limit).
"""

from __future__ import annotations

from .config import GatewayConfig, GatewayConfigError

__all__ = ["GatewayConfig", "GatewayConfigError", "create_app", "run_gateway"]


def create_app(config: GatewayConfig):
    from .app import create_app as _create_app

    return _create_app(config)


def run_gateway(config: GatewayConfig) -> None:
    """Serve until interrupted (uvicorn, one process), with `config`'s limits."""
    import sys

    import uvicorn

    from .config import is_loopback
    from .server import uvicorn_config

    if not config.api_key and not is_loopback(config.host):  # allowed only by allow_unauthenticated
        print(f"pagedserve openai: warning: serving {config.host} WITHOUT an API key (--allow-unauthenticated): "
              "anyone who can reach this port can use the models", file=sys.stderr, flush=True)
    print(
        f"pagedserve OpenAI API on http://{config.host}:{config.port}/v1 -> Triton gRPC {config.triton_url}, "
        f"models {sorted(config.model_ids())}{' (API key required)' if config.api_key else ''}",
        flush=True,
    )
    uvicorn.Server(uvicorn_config(config, create_app(config))).run()
