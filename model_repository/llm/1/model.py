"""Triton model `llm`: hosts the engine; text in, text out, decoupled.

Triton's vLLM backend's tensors (and token ids for the relays `llm_engine`,
`tensorrt_llm`, `tensorrt_llm_bls`). execute() only tokenizes and hands requests
to the engine thread; a thread of its own sends each step's text deltas (final
flag on the last), and a watcher aborts requests whose client cancelled.
The logic lives in pagedserve.backend.triton_adapter.engine_model.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.engine_model import TextEngineModel
from pagedserve.backend.triton_adapter.python_model import triton_python_model

TritonPythonModel = triton_python_model(pb_utils, TextEngineModel)
