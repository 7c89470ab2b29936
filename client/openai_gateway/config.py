"""The gateway's settings, validated once; fed by `pagedserve openai` and the Python API."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

API_KEY_ENV = "PAGEDSERVE_API_KEY"


class GatewayConfigError(ValueError):
    """A gateway setting is invalid; the message names it."""


@dataclass
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 9000
    """9000, as Triton's own OpenAI frontend."""
    triton_url: str = "localhost:8001"
    """gRPC endpoint of the tritonserver that serves the models."""
    models: list[str] = field(default_factory=lambda: ["llm"])
    """Triton models (text in, text out, vLLM-backend contract) offered as OpenAI models."""
    served_model_name: str | None = None
    """The OpenAI model id of the one model, when it should not be its Triton name."""
    api_key: str | None = None
    """Bearer key checked on every /v1 route; default: $PAGEDSERVE_API_KEY; none: open."""
    default_max_tokens: int = 16
    """max_tokens when a request gives none (vLLM's and Triton's frontend's default)."""

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if not 0 <= self.port <= 65535:
            raise GatewayConfigError(f"port: {self.port} is not a TCP port (0-65535)")
        if not self.models or not all(self.models):
            raise GatewayConfigError("models: name at least one Triton model, e.g. llm")
        if self.served_model_name is not None and len(self.models) != 1:
            raise GatewayConfigError("served_model_name: only with exactly one model")
        if self.default_max_tokens < 1:
            raise GatewayConfigError(f"default_max_tokens: {self.default_max_tokens} must be at least 1")
        if ":" not in self.triton_url:
            raise GatewayConfigError(f"triton_url: {self.triton_url!r} must be host:port (the gRPC port, e.g. localhost:8001)")

    def model_ids(self) -> dict[str, str]:
        """OpenAI model id -> Triton model name."""
        if self.served_model_name:
            return {self.served_model_name: self.models[0]}
        return {name: name for name in self.models}
