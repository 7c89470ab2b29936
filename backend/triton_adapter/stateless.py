"""The stateless `preprocessing` and `postprocessing` models, for users who build
their own ensembles: the same tokenizer steps `llm` runs in-process."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..errors import PagedServeError
from .arguments import tokenizer_from_args
from .requests import parse_prompt
from .finals import Failure
from .responses import postprocess_texts
from .tensors import Arrays, request_inputs, to_tensors

Handler = Callable[[Arrays], Mapping[str, np.ndarray]]


def stateless_execute(pb_utils: Any, requests: list[Any], handler: Handler) -> list[Any]:
    """One response per request; a PagedServeError becomes an INVALID_ARG error response
    for that request alone (anything else fails the batch: a bug, not the client's doing)."""
    responses = []
    for request in requests:
        try:
            outputs = handler(request_inputs(request))
            responses.append(pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, outputs)))
        except PagedServeError as error:
            responses.append(Failure(str(error), "INVALID_ARG").response(pb_utils))
    return responses


class TokenizerModel:
    """A non-decoupled model mapping each request's inputs to outputs with the tokenizer."""

    def __init__(self, pb_utils: Any, tokenizer: Any):
        self.pb_utils = pb_utils
        self.tokenizer = tokenizer

    @classmethod
    def from_args(cls, pb_utils: Any, args: Mapping[str, str]) -> TokenizerModel:
        return cls(pb_utils, tokenizer_from_args(args))

    def execute(self, requests: list[Any]) -> list[Any]:
        return stateless_execute(self.pb_utils, requests, self.handle)

    def finalize(self) -> None:
        """Nothing runs between requests."""

    def handle(self, inputs: Arrays) -> dict[str, np.ndarray]:
        raise NotImplementedError


class PreprocessingModel(TokenizerModel):
    """text (or chat messages) -> input_ids."""

    def handle(self, inputs: Arrays) -> dict[str, np.ndarray]:
        return {"input_ids": np.asarray(parse_prompt(inputs, self.tokenizer), dtype=np.int32)}


class PostprocessingModel(TokenizerModel):
    """released ids (+ their context ids) -> their exact text delta."""

    def handle(self, inputs: Arrays) -> dict[str, np.ndarray]:
        return {"text_output": np.array(postprocess_texts(inputs, self.tokenizer), dtype=np.object_)}
