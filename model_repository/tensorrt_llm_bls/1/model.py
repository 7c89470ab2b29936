"""Triton model `tensorrt_llm_bls`: TensorRT-LLM's text-level tensors, decoupled;
tokenizes here and streams through `llm` over BLS.
The logic lives in pagedserve.backend.triton_adapter.relay_model and .contracts.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.relay_model import TrtllmBlsModel

TritonPythonModel = triton_python_model(pb_utils, TrtllmBlsModel)
