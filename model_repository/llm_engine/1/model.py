"""Triton model `llm_engine`: decoupled; token ids in, token ids out.

A relay over BLS to `llm`, which hosts the engine and takes the same tensors:
one response per engine step per request, final flag on the last; a client's
cancellation aborts its request in the engine.
The logic lives in pagedserve.backend.triton_adapter.relay_model.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.relay_model import TokenRelayModel

TritonPythonModel = triton_python_model(pb_utils, TokenRelayModel)
