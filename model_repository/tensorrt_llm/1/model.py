"""Triton model `tensorrt_llm`: TensorRT-LLM's token-level tensors, decoupled; a relay
to `llm` (the one engine). The ensemble's middle step.
The logic lives in pagedserve.backend.triton_adapter.relay_model and .contracts.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.relay_model import TrtllmEngineModel

TritonPythonModel = triton_python_model(pb_utils, TrtllmEngineModel)
