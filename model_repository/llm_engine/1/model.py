"""Triton model `llm_engine`: decoupled; token ids in, token ids out.

execute() only hands requests to the engine thread and returns; responses (one
per engine step per request, final flag on the last) go out from a thread of
their own. A request carrying only `cancel_request_id` aborts that request.
The logic lives in pagedserve.backend.triton_adapter.engine_model.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.engine_model import EngineModel

TritonPythonModel = triton_python_model(pb_utils, EngineModel)
