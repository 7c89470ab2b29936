"""What the Triton model.py files share. `pb_utils` is passed in, never imported:
the package stays importable (and testable) without a server."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import numpy as np

from .errors import PagedServeError

Handler = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain name -> string dict."""
    config = json.loads(args["model_config"])
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def request_inputs(request: Any) -> dict[str, np.ndarray]:
    """The request's (or BLS response's) tensors as numpy arrays of our own.

    Copied: `as_numpy()` may view the shared memory of the request, which the backend
    frees once `execute()` returns (decoupled models outlive that), and of a BLS
    response, which goes when the response object does.
    """
    return tensor_arrays(request.inputs())


def tensor_arrays(tensors: Any) -> dict[str, np.ndarray]:
    return {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in tensors}


def to_tensors(pb_utils: Any, arrays: Mapping[str, np.ndarray]) -> list[Any]:
    return [pb_utils.Tensor(name, _triton_array(array)) for name, array in arrays.items()]


def _triton_array(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.object_:  # STRING tensors travel as bytes
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in array.reshape(-1)], dtype=np.object_).reshape(array.shape)
    return array


def stateless_execute(pb_utils: Any, requests: list[Any], handler: Handler) -> list[Any]:
    """One response per request; a PagedServeError becomes an INVALID_ARG error response."""
    responses = []
    for request in requests:
        try:
            outputs = handler(request_inputs(request))
            responses.append(pb_utils.InferenceResponse(output_tensors=to_tensors(pb_utils, outputs)))
        except PagedServeError as error:
            responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)))
    return responses
