"""pagedserve engine: paged KV cache, in-flight batching scheduler, sampler, models.

No Triton import here: the engine runs and is tested without a server.
"""

from .config import EngineConfig
from .engine import LLMEngine
from .errors import ConfigError, EngineDeadError, InvalidRequestError, PagedServeError, QueueFullError
from .outputs import Completion, EngineStats, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "Completion",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "PagedServeError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]
