"""A GGUF file's header read without materialising its large arrays: scalar and short-array
metadata, and every tensor's name, shape, type and bytes (a view of a memory map). gguf's own
GGUFReader builds Python objects for the whole vocabulary, seconds per load; this takes ms."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# value type → struct format (GGUF metadata value types 0-12; 8 string and 9 array apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMERIC = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}
SHORT_ARRAY = 64  # arrays up to this long are kept as lists; longer ones only by length


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    type_name: str  # gguf.GGMLQuantizationType name: F32, Q4_1, ...
    data: np.ndarray  # uint8 [rows, row bytes] for block types, float values otherwise


@dataclass
class LongArray:
    """A metadata array too long to keep (the vocabulary, merges): its length only."""

    length: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self._pos = 0
        if self._map[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (or not little-endian)")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or later)")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self.tensors = [self._tensor(name, shape, ttype, start + off) for name, shape, ttype, off in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = self._map[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype}")
        etype, count = self._unpack("<IQ")
        if count <= SHORT_ARRAY:
            return [self._value(etype) for _ in range(count)]
        if etype in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[etype])
        elif etype == _STRING:  # walk the lengths without decoding
            m, pos = self._map, self._pos
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", m, pos)[0]
            self._pos = pos
        else:
            for _ in range(count):
                self._value(etype)
        return LongArray(count)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        shape = self._unpack(f"<{n_dims}Q")
        ttype, offset = self._unpack("<IQ")
        return name, tuple(int(x) for x in shape), ttype, offset

    def _tensor(self, name: str, shape: tuple[int, ...], ttype: int, offset: int) -> GGUFTensor:
        import gguf

        qtype = gguf.GGMLQuantizationType(ttype)
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = shape[0] // block * nbytes
        raw = self._buf[offset : offset + rows * row_bytes].reshape(rows, row_bytes)
        if qtype.name == "BF16":  # the high half of a float32
            raw = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif qtype.name in _NUMERIC:
            raw = raw.view(_NUMERIC[qtype.name])
        data = raw.reshape(tuple(reversed(shape))) if block == 1 else raw
        return GGUFTensor(name, shape, qtype.name, data)

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)
