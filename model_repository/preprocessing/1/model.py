"""Triton model `preprocessing`: text (or chat messages) -> input_ids. Logic lives in pagedserve."""

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.backend.loader import load_tokenizer, resolve_model_path
from pagedserve.backend.triton_glue import model_parameters, stateless_execute
from pagedserve.backend.triton_protocol import parse_prompt


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(resolve_model_path(model_parameters(args).get("model", "")))

    def execute(self, requests):
        return stateless_execute(pb_utils, requests, self._encode)

    def _encode(self, inputs):
        return {"input_ids": np.asarray(parse_prompt(inputs, self.tokenizer), dtype=np.int32)}
