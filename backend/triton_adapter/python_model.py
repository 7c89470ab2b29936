"""The `TritonPythonModel` class each model.py hands to Triton, made in one place.

Triton finds a python model by that class name in its model.py; every one of ours
only forwards the three lifecycle calls to an adapter class, so the shim is built
here rather than written four times.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Protocol


class Adapter(Protocol):
    def execute(self, requests: list[Any]) -> list[Any] | None: ...

    def finalize(self) -> None: ...


class AdapterFactory(Protocol):
    def from_args(self, pb_utils: Any, args: Mapping[str, str]) -> Adapter: ...


def triton_python_model(pb_utils: Any, adapter: AdapterFactory) -> type:
    """A TritonPythonModel class whose instances delegate to `adapter.from_args(pb_utils, args)`."""

    class TritonPythonModel:
        def initialize(self, args: Mapping[str, str]) -> None:
            forward_logs_to_triton(pb_utils)
            self.model = adapter.from_args(pb_utils, args)

        def execute(self, requests: list[Any]) -> list[Any] | None:
            return self.model.execute(requests)

        def finalize(self) -> None:
            self.model.finalize()

        def is_ready(self) -> bool:
            """Asked by Triton releases whose python backend supports it (python_backend#430,
            2026) on every `/v2/models/<name>/ready`: the model's own readiness, where it has one."""
            model = getattr(self, "model", None)
            return model is not None and bool(getattr(model, "is_ready", lambda: True)())

    TritonPythonModel.__qualname__ = f"TritonPythonModel[{getattr(adapter, '__name__', adapter)}]"
    return TritonPythonModel


def log_info(pb_utils: Any, message: str) -> None:
    """An INFO line of this model in the server's log (pb_utils.Logger; absent in fakes)."""
    log = getattr(getattr(pb_utils, "Logger", None), "log_info", None)
    if log is not None:
        log(message)


class TritonLogHandler(logging.Handler):
    """The engine's `pagedserve` log records (start-up choices such as the dtype and why,
    failures) as lines of the server's log, through pb_utils.Logger."""

    def __init__(self, logger: Any):
        super().__init__(logging.INFO)
        self.logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                self.logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                self.logger.log_warn(message)
            else:
                self.logger.log_info(message)
        except Exception:  # noqa: BLE001 (a log line must never fail a request)
            self.handleError(record)


def forward_logs_to_triton(pb_utils: Any) -> None:
    """Once per stub process: the `pagedserve` logger writes to Triton's log."""
    logger = logging.getLogger("pagedserve")
    triton_logger = getattr(pb_utils, "Logger", None)
    if triton_logger is None or any(isinstance(h, TritonLogHandler) for h in logger.handlers):
        return
    logger.addHandler(TritonLogHandler(triton_logger))
    logger.setLevel(logging.INFO)
