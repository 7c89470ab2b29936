"""Triton model `postprocessing`: released ids (+ their context ids) -> exact text delta."""

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.backend.loader import load_tokenizer, resolve_model_path
from pagedserve.backend.triton_glue import model_parameters, stateless_execute
from pagedserve.backend.triton_protocol import postprocess_text


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(resolve_model_path(model_parameters(args).get("model", "")))

    def execute(self, requests):
        return stateless_execute(pb_utils, requests, self._decode)

    def _decode(self, inputs):
        return {"text_output": np.array([postprocess_text(inputs, self.tokenizer)], dtype=np.object_)}
