"""Error types the engine raises; each names what was wrong and how to fix it.

The Triton model turns these into error responses, so their messages are what
users read.
"""

from __future__ import annotations


class PagedServeError(Exception):
    """Base class for every error the engine raises on purpose."""


class ConfigError(PagedServeError, ValueError):
    """An engine configuration value is invalid (raised once, at start-up)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"config '{field}': {message}")


class InvalidRequestError(PagedServeError, ValueError):
    """A request (prompt or sampling parameter) is invalid; names the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"'{field}': {message}")


class QueueFullError(PagedServeError):
    """The waiting queue is at max_queue_size: the caller should retry later."""


class EngineStepError(PagedServeError):
    """An engine step failed; the requests in it were dropped and the engine recovered."""


class EngineHungError(PagedServeError):
    """An engine step ran past step_timeout_s; the requests in flight were dropped."""


class EngineDeadError(PagedServeError):
    """The engine loop failed; in-flight and new requests cannot be served."""
