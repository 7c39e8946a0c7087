"""A fast, read-only GGUF parser: metadata as Python values, tensor infos, mmap'd tensor data.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value, which takes
seconds for a 50k-token vocabulary (and ~10 s on a busy CPU). This parser reads the same
format (GGUF v2/v3, little-endian) with ``struct`` over one ``mmap`` and returns plain Python
values; tensor bytes are views into that mmap, shaped exactly as ``GGUFReader`` shapes them
(so ``gguf.quants.dequantize`` accepts them).

Layout: magic ``GGUF``, version u32, tensor count u64, KV count u64; KVs (string key, u32
type, value; arrays are u32 element type + u64 count + elements); tensor infos (name,
u32 n_dims, u64 dims (innermost first), u32 ggml type, u64 offset); tensor data from the
first ``general.alignment`` (default 32) boundary after the infos.

Invariants: every read is bounds-checked, so a truncated or corrupt file raises
``GGUFFormatError`` naming what was being read, never a crash or a short tensor; float32
scalars become their shortest round-tripping decimal (``9.99999975e-06`` -> ``1e-05``).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS: dict[int, tuple[str, int]] = {  # GGUFValueType -> (struct code, size)
    0: ("B", 1),  # UINT8
    1: ("b", 1),  # INT8
    2: ("H", 2),  # UINT16
    3: ("h", 2),  # INT16
    4: ("I", 4),  # UINT32
    5: ("i", 4),  # INT32
    6: ("f", 4),  # FLOAT32
    7: ("?", 1),  # BOOL
    10: ("Q", 8),  # UINT64
    11: ("q", 8),  # INT64
    12: ("d", 8),  # FLOAT64
}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_NP_TYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF (bad magic/version, truncated, corrupt)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """Row-major shape (``[out, in]`` for a weight)."""
        return tuple(reversed(self.dims))


def f32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (how the value was written)."""
    return float(str(np.float32(value)))


class GGUFFile:
    """``metadata`` (key -> Python value), ``tensors`` (in file order), ``tensor_data(info)``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: empty file
            raise GGUFFormatError(f"cannot map {self.path}: {exc}") from exc
        self._pos = 0
        if self._bytes(4, "magic") != _MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic)")
        version = self._unpack("I", 4, "version")
        if version not in (2, 3):
            hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
            raise GGUFFormatError(f"GGUF version {version} is not supported (2, 3){hint}")
        n_tensors = self._unpack("Q", 8, "tensor count")
        n_kv = self._unpack("Q", 8, "metadata count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string("metadata key")
            self.metadata[key] = self._value(self._unpack("I", 4, f"type of {key}"), key)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment must be a power of two, got {align!r}")
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensorInfo] = []
        seen: set[str] = set()
        for name, dims, ggml_type, rel in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            info = self._make_info(name, dims, ggml_type, start + rel)
            self.tensors.append(info)

    # -- tensors ------------------------------------------------------------------------
    def _make_info(self, name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensorInfo:
        import gguf

        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {ggml_type}") from exc
        if not dims or min(dims) < 1:
            raise GGUFFormatError(f"tensor {name!r} has dimensions {list(dims)}")
        n_elems = math.prod(dims)
        if dims[0] % block:
            raise GGUFFormatError(f"tensor {name!r}: row of {dims[0]} is not a multiple of block {block}")
        n_bytes = n_elems // block * type_size
        if offset + n_bytes > len(self._mm):
            raise GGUFFormatError(
                f"tensor {name!r} needs bytes [{offset}, {offset + n_bytes}) but the file has {len(self._mm)} "
                "(truncated?)"
            )
        return GGUFTensorInfo(name, qtype, dims, offset, n_bytes)

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """Read-only view of the tensor's bytes, typed and shaped as ``gguf.GGUFReader`` does."""
        import gguf

        shape = info.hf_shape
        typed = {
            gguf.GGMLQuantizationType.F32: np.float32,
            gguf.GGMLQuantizationType.F16: np.float16,
            gguf.GGMLQuantizationType.F64: np.float64,
            gguf.GGMLQuantizationType.I8: np.int8,
            gguf.GGMLQuantizationType.I16: np.int16,
            gguf.GGMLQuantizationType.I32: np.int32,
            gguf.GGMLQuantizationType.I64: np.int64,
        }.get(info.tensor_type)
        if typed is not None:
            count = info.n_bytes // np.dtype(typed).itemsize
            return np.frombuffer(self._mm, typed, count, info.offset).reshape(shape)
        raw = np.frombuffer(self._mm, np.uint8, info.n_bytes, info.offset)
        return raw.reshape(gguf.quant_shape_to_byte_shape(shape, info.tensor_type))

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("tensor name")
        n_dims = self._unpack("I", 4, f"dims of {name}")
        if n_dims > 8:
            raise GGUFFormatError(f"tensor {name!r} claims {n_dims} dimensions")
        dims = tuple(self._unpack("Q", 8, f"dims of {name}") for _ in range(n_dims))
        ggml_type = self._unpack("I", 4, f"type of {name}")
        offset = self._unpack("Q", 8, f"offset of {name}")
        return name, dims, ggml_type, offset

    # -- metadata values ----------------------------------------------------------------
    def _value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self._string(key)
        if vtype == _ARRAY:
            etype = self._unpack("I", 4, f"array type of {key}")
            count = self._unpack("Q", 8, f"array length of {key}")
            if etype == _STRING:
                return [self._string(key) for _ in range(count)]
            if etype in _NP_TYPES:
                size = _SCALARS[etype][1] * count
                self._need(size, key)
                values = np.frombuffer(self._mm, _NP_TYPES[etype], count, self._pos).tolist()
                self._pos += size
                return values
            if etype == _ARRAY:
                return [self._value(_ARRAY, key) for _ in range(count)]
            raise GGUFFormatError(f"metadata {key!r}: unknown array element type {etype}")
        if vtype in _SCALARS:
            code, size = _SCALARS[vtype]
            value = self._unpack(code, size, key)
            return f32_decimal(value) if vtype == _FLOAT32 else value
        raise GGUFFormatError(f"metadata {key!r}: unknown value type {vtype}")

    def _string(self, what: str) -> str:
        n = self._unpack("Q", 8, what)
        raw = self._bytes(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"{what}: invalid UTF-8") from exc

    def _need(self, n: int, what: str) -> None:
        if self._pos + n > len(self._mm):
            raise GGUFFormatError(f"file ends while reading {what} (truncated?)")

    def _bytes(self, n: int, what: str) -> bytes:
        self._need(n, what)
        out = self._mm[self._pos : self._pos + n]
        self._pos += n
        return out

    def _unpack(self, code: str, size: int, what: str) -> Any:
        self._need(size, what)
        (value,) = struct.unpack_from("<" + code, self._mm, self._pos)
        self._pos += size
        return value
