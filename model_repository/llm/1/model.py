"""Triton model `llm`: text in, text out, decoupled.

Tokenizes in-process, streams the request through `llm_engine` over BLS, and
turns each engine response into a text delta. It is a python model rather than
an ensemble because Triton (2.51) does not pass a client's cancellation into an
ensemble's steps: here a watcher sees it and tells llm_engine to abort.
The logic lives in pagedserve.backend.triton_adapter.text_model.
"""

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton_adapter.python_model import triton_python_model
from pagedserve.backend.triton_adapter.text_model import TextModel

TritonPythonModel = triton_python_model(pb_utils, TextModel)
