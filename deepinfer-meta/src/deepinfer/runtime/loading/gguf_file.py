"""A minimal memory-mapped GGUF reader: metadata values and tensor views, parsed in milliseconds.

``gguf.GGUFReader`` builds a numpy object per array element of the metadata (a 49k-token
vocabulary and its merges: ~150k parts), which takes 2-15 s; the weights loader needs only the
scalar fields, the length of arrays and the tensor table. String arrays are therefore skipped
(only their length is kept) and numeric arrays are numpy views. Tensor type names and block sizes
come from ``gguf.constants``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUFValueType -> struct format of a scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, of which only the length is read."""

    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class TensorInfo:
    """One tensor: ``shape`` in GGUF order (innermost first), its type and its bytes (a read-only view)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class _Cursor:
    """Sequential reads from the header bytes (a memoryview of the mapped file)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def _check(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"truncated at byte {self.pos} (wanted {n} more)")

    def take(self, n: int) -> bytes:
        self._check(n)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALARS[vtype]
        size = struct.calcsize(fmt)
        self._check(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        return self.take(self.scalar(10)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self.scalar(4), self.scalar(10)
        if etype == _STRING:
            pos, buf, unpack = self.pos, self.buf, struct.unpack_from
            for _ in range(count):  # skip each string: 8-byte length + bytes
                pos += 8 + unpack("<Q", buf, pos)[0]  # struct.error past the end
            self.pos = pos
            self._check(0)
            return StringArray(count)
        if etype not in _NUMPY:
            raise ValueError(f"unsupported metadata array element type {etype}")
        size = np.dtype(_NUMPY[etype]).itemsize * count
        self._check(size)
        out: np.ndarray = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
        self.pos += size
        return out


class GGUFFile:
    """``fields`` (key -> value) and ``tensors`` of a GGUF file; the file stays memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = os.fspath(path)
        buf = np.memmap(self.path, mode="r", dtype=np.uint8)
        cur = _Cursor(memoryview(buf))  # type: ignore[arg-type]  # a memmap is a buffer
        if cur.take(4) != _MAGIC:
            raise ValueError("no GGUF magic")
        version = cur.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_fields = cur.scalar(10), cur.scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            self.fields[key] = cur.value(cur.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar(10) for _ in range(cur.scalar(4)))
            ttype, offset = GGMLQuantizationType(cur.scalar(4)), cur.scalar(10)
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (cur.pos + align - 1) // align * align
        self.tensors: list[TensorInfo] = []
        for name, dims, ttype, offset in infos:
            block, nbytes = GGML_QUANT_SIZES[ttype]
            n = int(np.prod(dims))
            size = n // block * nbytes
            begin = start + offset
            if begin + size > buf.size:
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated)")
            self.tensors.append(TensorInfo(name, dims, ttype, buf[begin:begin + size]))
