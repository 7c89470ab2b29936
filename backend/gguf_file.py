"""A lean GGUF reader: metadata and tensor views over one mmap.

The `gguf` package's reader builds numpy views for every token string of the
vocabulary and takes seconds; this one walks the file with struct and leaves
tensor decoding to `gguf.quants.dequantize`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {0: np.float32, 1: np.float16}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first)
    qtype: int
    data: np.ndarray  # raw bytes or floats as stored

    def to_numpy(self) -> np.ndarray:
        """Float32 array of the tensor (dequantized)."""
        if self.qtype in _FLOAT_TYPES:
            return self.data.astype(np.float32).reshape(self.shape)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(self.data, GGMLQuantizationType(self.qtype)).reshape(self.shape)


class GGUFFile:
    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._map[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self._offset = 4
        version = self._read("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or 3 expected)")
        num_tensors, num_fields = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._read_string()
            self.fields[key] = self._read_value(self._read("<I"), keep_arrays=not key.startswith("tokenizer.ggml."))
        infos = []
        for _ in range(num_tensors):
            name = self._read_string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, shape, qtype, data_start + offset) for name, shape, qtype, offset in infos]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _tensor(self, name: str, shape: tuple[int, ...], qtype: int, offset: int) -> GGUFTensor:
        count = int(np.prod(shape))
        if qtype in _FLOAT_TYPES:
            data = np.frombuffer(self._map, dtype=_FLOAT_TYPES[qtype], count=count, offset=offset)
        else:
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            row_bytes = shape[-1] // block * type_size
            data = np.frombuffer(self._map, dtype=np.uint8, count=count // shape[-1] * row_bytes, offset=offset)
            data = data.reshape(-1, row_bytes)
        return GGUFTensor(name, shape, qtype, data)

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._read("<Q")
        raw = self._map[self._offset : self._offset + length]
        self._offset += length
        return raw.decode("utf-8", errors="replace")

    def _read_value(self, kind: int, keep_arrays: bool = True) -> Any:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._read_string()
        if kind == _ARRAY:
            item_kind, count = self._read("<I"), self._read("<Q")
            if item_kind in _SCALARS and not keep_arrays:  # skip large numeric arrays quickly
                self._offset += count * struct.calcsize(_SCALARS[item_kind])
                return count
            items = [self._read_value(item_kind, keep_arrays) for _ in range(count)]
            return items if keep_arrays else count
        raise ValueError(f"unknown GGUF value type {kind}")
