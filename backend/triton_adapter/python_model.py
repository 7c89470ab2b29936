"""The `TritonPythonModel` class each model.py hands to Triton, made in one place.

Triton finds a python model by that class name in its model.py; every one of ours
only forwards the three lifecycle calls to an adapter class, so the shim is built
here rather than written four times.
"""

from __future__ import annotations

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
            self.model = adapter.from_args(pb_utils, args)

        def execute(self, requests: list[Any]) -> list[Any] | None:
            return self.model.execute(requests)

        def finalize(self) -> None:
            self.model.finalize()

    TritonPythonModel.__qualname__ = f"TritonPythonModel[{getattr(adapter, '__name__', adapter)}]"
    return TritonPythonModel


def log_info(pb_utils: Any, message: str) -> None:
    """An INFO line of this model in the server's log (pb_utils.Logger; absent in fakes)."""
    log = getattr(getattr(pb_utils, "Logger", None), "log_info", None)
    if log is not None:
        log(message)
