"""A GGUF file's metadata and tensor index, read in one pass over its header (no torch).

gguf's GGUFReader keeps a numpy view of every part of every metadata item: for a vocabulary and its merges that is
~250,000 views, 1-1.5 s to open SmolLM2's file and more for larger vocabularies, at every engine start and for every
tensor-parallel rank. This reads the same header with ``struct`` (strings decoded, number arrays as one numpy read)
and hands out each tensor's bytes as the same numpy view of the file's map that GGUFReader gives
(tests/models/test_gguf_file.py checks fields and tensors against GGUFReader's). gguf's constants (value types,
quantization types and their block sizes) are the library's own.

Layout (GGUF v2 and v3, little-endian): magic, version u32, tensor count u64, metadata count u64; each metadata item
a string key, a value type u32 and its value (an array: element type u32, count u64, elements); each tensor a string
name, its dimension count u32, dimensions u64 (innermost first), its type u32 and its offset u64 from the data
section, which starts at the first multiple of ``general.alignment`` (32 by default) after the header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Scalar value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types that GGUFReader hands out as elements (every other type as raw bytes).
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order, innermost first (GGUFReader's ``shape``)
    n_elements: int
    data: np.ndarray  # a view of the file's map: elements for plain types, raw bytes [..., row bytes] otherwise


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> value (int, float, bool, str, or a list of them)
    tensors: list[GGUFTensor]
    data: np.ndarray  # the whole file's map (uint8)


class _Cursor:
    def __init__(self, buffer: np.ndarray):
        self.buffer, self.view, self.offset = buffer, memoryview(buffer), 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.view, self.offset)[0]
        self.offset += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        size = self.take("Q")
        text = bytes(self.view[self.offset:self.offset + size]).decode("utf-8")
        self.offset += size
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.offset}")
        element, count = self.take("I"), self.take("Q")
        if element in _SCALARS and element != 7:  # numbers: one read
            dtype = np.dtype("<" + _SCALARS[element])
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        return [self.value(element) for _ in range(count)]


def read_gguf(path: Path | str) -> GGUFFile:
    """``path``'s metadata and tensors (ValueError for a file that is not GGUF v2/v3 little-endian, or is cut short)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    data = np.memmap(path, mode="r").view(np.ndarray)  # a plain view: slicing a np.memmap runs Python code each time
    cursor = _Cursor(data)
    try:
        if bytes(cursor.view[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cursor.offset = 4
        version = cursor.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as a "
                             f"huge version)")
        tensor_count, field_count = cursor.take("Q"), cursor.take("Q")
        fields = {}
        for _ in range(field_count):
            key = cursor.string()
            fields[key] = cursor.value(cursor.take("I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
            infos.append((name, GGMLQuantizationType(cursor.take("I")), dims, cursor.take("Q")))
    except struct.error:
        raise ValueError("the GGUF header is cut short") from None
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}")
    start = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, kind, dims, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name} appears twice")
        names.add(name)
        n_elements = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))
        element = _ELEMENT_TYPES.get(kind.name)
        if element is None:  # quantized blocks: raw bytes, rows of the innermost dimension's bytes
            block, block_bytes = GGML_QUANT_SIZES[kind]
            dtype, count, shape = np.uint8, n_elements // block * block_bytes, quant_shape_to_byte_shape(shape, kind)
        else:
            dtype, count = element, n_elements
        at = start + offset
        if at + count * np.dtype(dtype).itemsize > data.size:
            raise ValueError(f"tensor {name} lies past the end of the file")
        tensors.append(GGUFTensor(name, kind, dims, n_elements,
                                  np.frombuffer(data, dtype, count, at).reshape(shape)))
    return GGUFFile(fields, tensors, data)
