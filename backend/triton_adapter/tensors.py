"""Numpy views of Triton tensors: typed accessors for optional inputs, and the
copies in and out of Triton's tensor objects.

`pb_utils` is passed in, never imported, so this imports without a server.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import InvalidRequestError

Arrays = Mapping[str, np.ndarray]


def scalar(inputs: Arrays, name: str) -> Any:
    """The single value of an optional input (None when absent); bytes come back as str."""
    array = inputs.get(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise InvalidRequestError(name, f"must hold exactly one value, got shape {tuple(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        return decode_utf8(name, bytes(value))
    return value.item() if isinstance(value, np.generic) else value


def strings(inputs: Arrays, name: str) -> list[str]:
    """Every value of an optional STRING input, decoded ([] when absent)."""
    array = inputs.get(name)
    if array is None:
        return []
    return [decode_utf8(name, bytes(v)) if isinstance(v, (bytes, np.bytes_)) else str(v) for v in np.asarray(array).reshape(-1)]


def decode_utf8(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(name, f"is not valid UTF-8 (bad byte at position {error.start}); send UTF-8 text") from None


def flag(inputs: Arrays, name: str, default: bool = False) -> bool:
    """An optional BOOL input; any other type is the client's mistake, not a truthy value."""
    value = scalar(inputs, name)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidRequestError(name, f"must be a BOOL, got {value!r}")


def token_ids(inputs: Arrays, name: str) -> list[int]:
    """A required integer tensor of token ids, flattened."""
    array = inputs.get(name)
    if array is None:
        raise InvalidRequestError(name, "is required (the prompt's token ids)")
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise InvalidRequestError(name, f"must be integer token ids, got dtype {array.dtype}")
    return [int(t) for t in array.reshape(-1)]


def request_inputs(request: Any) -> dict[str, np.ndarray]:
    """The request's (or BLS response's) tensors as numpy arrays of our own.

    Copied: `as_numpy()` may view the shared memory of the request, which the backend
    frees once `execute()` returns (decoupled models outlive that), and of a BLS
    response, which goes when the response object does.
    """
    return tensor_arrays(request.inputs())


def tensor_arrays(tensors: Iterable[Any]) -> dict[str, np.ndarray]:
    """Copies of pb_utils tensors (see request_inputs for why a copy)."""
    return {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in tensors}


def to_tensors(pb_utils: Any, arrays: Arrays) -> list[Any]:
    """pb_utils tensors of arrays; str values of STRING tensors travel as UTF-8 bytes."""
    return [pb_utils.Tensor(name, _triton_array(array)) for name, array in arrays.items()]


def _triton_array(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.object_:  # STRING tensors travel as bytes
        encoded = [v.encode("utf-8") if isinstance(v, str) else v for v in array.reshape(-1)]
        return np.array(encoded, dtype=np.object_).reshape(array.shape)
    return array
