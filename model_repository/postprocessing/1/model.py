"""Triton model `postprocessing`: TensorRT-LLM's last ensemble step (TOKENS_BATCH -> OUTPUT), exact text.

The logic lives in pagedserve.backend.triton_adapter.stateless.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.stateless import PostprocessingModel

TritonPythonModel = triton_python_model(pb_utils, PostprocessingModel)
