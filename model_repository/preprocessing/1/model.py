"""Triton model `preprocessing`: TensorRT-LLM's first ensemble step (QUERY -> INPUT_ID ...).

The logic lives in pagedserve.backend.triton_adapter.stateless.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.stateless import PreprocessingModel

TritonPythonModel = triton_python_model(pb_utils, PreprocessingModel)
