"""How a Triton request ends: with exactly one final response, errors included.

A decoupled request that never gets a final stays alive in Triton for good: the
model never unloads and the server waits out `--exit-timeout-secs` on shutdown.
So a failed send still closes the request (a flag-only final), and a failure is
kept as a `Failure` (message + code name) that can travel two ways: as a Triton
error to a client, or as data in the `error` output to `llm`. The second exists
because Triton 2.51 loses a BLS error response that is not a stream's first
(python_backend r24.10 does not store its response id), so the engine's model never
answers `llm` with an error response.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import EngineDeadError, InvalidRequestError, QueueFullError

logger = logging.getLogger("pagedserve")

ERROR_OUTPUT = "error"
"""the engine's output carrying a Failure as JSON, sent only to BLS callers."""


@dataclass(frozen=True)
class Failure:
    """Why a request ended badly; `code` names a pb_utils.TritonError code."""

    message: str
    code: str = "INTERNAL"

    @classmethod
    def of(cls, error: Exception) -> Failure:
        """The client's view of an exception: its own mistake (INVALID_ARG), try again
        later (UNAVAILABLE), or ours (INTERNAL, with the exception's type)."""
        if isinstance(error, InvalidRequestError):
            return cls(str(error), "INVALID_ARG")
        if isinstance(error, (QueueFullError, EngineDeadError)):
            return cls(str(error), "UNAVAILABLE")
        return cls(f"{type(error).__name__}: {error}", "INTERNAL")

    def triton_error(self, pb_utils: Any) -> Any:
        codes = pb_utils.TritonError
        return codes(self.message, getattr(codes, self.code, codes.INTERNAL))

    def response(self, pb_utils: Any) -> Any:
        """An InferenceResponse carrying only this error."""
        return pb_utils.InferenceResponse(error=self.triton_error(pb_utils))

    def tensors(self) -> dict[str, np.ndarray]:
        """This failure as the engine's `error` output."""
        return {ERROR_OUTPUT: np.array([json.dumps({"code": self.code, "message": self.message})], dtype=np.object_)}

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, np.ndarray]) -> Failure:
        raw = outputs[ERROR_OUTPUT].reshape(-1)[0]
        fields = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        return cls(str(fields.get("message", "the engine failed")), str(fields.get("code", "INTERNAL")))


CANCELLED = Failure("request cancelled", "CANCELLED")


def send_final(response_sender: Any, response: Any, final_flag: int) -> bool:
    """Send `response` (None: none) with the final flag; False when that failed.

    When sending `response` failed, a flag-only final is tried: the server ends the
    request on any final it receives. (If the stub refused the first one before
    sending it, it has marked the sender closed and the second raises too.)
    """
    try:
        if response is None:
            response_sender.send(flags=final_flag)
        else:
            response_sender.send(response, flags=final_flag)
        return True
    except Exception:
        logger.exception("sending a final response failed")
    if response is not None:
        try:
            response_sender.send(flags=final_flag)
        except Exception:  # noqa: BLE001 - the sender is closed already: the server has the final
            pass
    return False
