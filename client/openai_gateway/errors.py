"""OpenAI-shaped errors: the status code and `{"error": {...}}` body OpenAI clients parse."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .schemas import ErrorBody, ErrorResponse

# OpenAI's error `type` per status, as its SDK maps them to exception classes.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    499: "cancelled",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout",
}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        error = ErrorBody(message=self.message, type=_TYPES.get(self.status, "api_error"), param=self.param, code=self.code)
        return ErrorResponse(error=error).model_dump()


def unsupported(param: str, why: str = "is not supported by this server") -> OpenAIError:
    return OpenAIError(400, f"`{param}` {why}", param=param, code="unsupported_parameter")


# How the `llm` model words its errors (backend/errors.py, backend/triton_adapter/finals.py):
# a request error starts with the quoted field ("'temperature': must be ..."); a full
# queue says "server busy"; a dead or stopping engine says so.
_FIELD = re.compile(r"^(?:\[[^\]]*\]\s*)?'([A-Za-z_][\w.]*)':")
_UNAVAILABLE = ("server busy", "shutting down", "the engine failed earlier", "the engine shut down", "not ready",
                "unavailable", "failed to connect", "connection refused", "stub process is not healthy",
                "unknown model")


def from_triton(message: str) -> OpenAIError:
    """A Triton error message as an OpenAI error with a fitting status: 400 for a
    request the model refused, 503 when the server cannot take it now, 500 otherwise."""
    lowered = message.lower()
    if any(marker in lowered for marker in _UNAVAILABLE):
        return OpenAIError(503, message)
    field = _FIELD.search(message)
    if field or "invalid argument" in lowered or "error generating stream" in lowered:
        return OpenAIError(400, message, param=field.group(1) if field else None)
    if "cancelled" in lowered:
        return OpenAIError(499, message)
    return OpenAIError(500, message)
