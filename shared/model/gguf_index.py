"""A GGUF file's metadata and tensor directory, read in milliseconds.

`gguf.GGUFReader` builds a numpy view of every part of every metadata value: for the default model's tokenizer
(49,152 tokens and 48,900 merges) that is about 2 s of every process start and of every engine built in one. This
reads the same layout (GGUF v2 / v3, little-endian) with `struct`: scalars and strings become Python values, numeric
arrays lists, and string arrays stay as offsets into the file until asked for (`StringArray`). Tensors are numpy
views of a read-only memory map, with the dtype and shape GGUFReader gives them (quantised types: uint8 rows of
blocks), so `gguf.quants.dequantize` reads them as it reads the reader's. The `gguf` package's constants name the
types; its reader stays the reference the tests compare this one against.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

# value type -> the struct format of the scalar types (numpy reads the same codes for arrays of them)
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# tensor types stored as plain arrays (the others: uint8 bytes of quantised blocks)
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class StringArray:
    """An array of strings in the file, decoded when indexed."""

    def __init__(self, buf: memoryview, start: int, count: int) -> None:
        self._buf, self._start, self._count = buf, start, count
        self._offsets: list[int] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> str:
        if self._offsets is None:
            self._offsets, _ = _walk_strings(self._buf, self._start, self._count)
        o = self._offsets[range(self._count)[i]]
        n = int.from_bytes(self._buf[o:o + 8], "little")
        return str(self._buf[o + 8:o + 8 + n], "utf-8")

    def tolist(self) -> list[str]:
        return [self[i] for i in range(self._count)]


def _walk_strings(buf: memoryview, offset: int, count: int) -> tuple[list[int], int]:
    """-> (each string's offset, the offset after the last)."""
    offsets = []
    for _ in range(count):
        offsets.append(offset)
        offset += 8 + int.from_bytes(buf[offset:offset + 8], "little")
    return offsets, offset


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]          # GGUF's order: fastest-varying dimension first
    data: np.ndarray                # a read-only view of the file (see the module's docstring for its shape)


class GGUFIndex:
    """fields: key -> int / float / bool / str / list (numeric arrays) / StringArray; tensors in file order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, mode="r")
        try:
            self._read(memoryview(self._map))
        except (struct.error, IndexError, UnicodeDecodeError) as e:     # a read past the end, a cut string
            raise ValueError(f"{path} is truncated or corrupt: {e}") from None

    def _read(self, buf: memoryview) -> None:
        path = self.path
        if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version & 0xFFFFFFFF} is not read here (2 and 3 are, "
                             "little-endian)")
        offset = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key, offset = self._string(buf, offset)
            (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
            if key in self.fields:
                raise ValueError(f"{path}: the metadata key {key!r} appears twice")
            self.fields[key], offset = self._value(buf, offset, GGUFValueType(kind))
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(buf, offset)
            (n_dims,), offset = struct.unpack_from("<I", buf, offset), offset + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offset)
            kind, start = struct.unpack_from("<IQ", buf, offset + 8 * n_dims)
            offset += 8 * n_dims + 12
            infos.append((name, GGMLQuantizationType(kind), dims, start))
        align = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: general.alignment must be a power of two, got {align!r}")
        base = -(-offset // align) * align
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, kind, dims, start in infos:
            if name in seen:
                raise ValueError(f"{path}: the tensor {name!r} appears twice")
            seen.add(name)
            n = int(np.prod(dims))
            shape = tuple(reversed(dims))
            block, size = GGML_QUANT_SIZES[kind]
            if kind in _PLAIN:
                dtype, count = _PLAIN[kind], n
            else:
                dtype, count, shape = np.uint8, n * size // block, quant_shape_to_byte_shape(shape, kind)
            begin = base + start
            end = begin + count * np.dtype(dtype).itemsize
            if end > len(self._map):
                raise ValueError(f"{path}: the tensor {name!r} runs past the end of the file")
            data = self._map[begin:end].view(dtype).reshape(shape)
            self.tensors.append(GGUFTensor(name, kind, tuple(dims), data))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @staticmethod
    def _string(buf: memoryview, offset: int) -> tuple[str, int]:
        n = int.from_bytes(buf[offset:offset + 8], "little")
        return str(buf[offset + 8:offset + 8 + n], "utf-8"), offset + 8 + n

    def _value(self, buf: memoryview, offset: int, kind: GGUFValueType) -> tuple[Any, int]:
        if kind == GGUFValueType.STRING:
            return self._string(buf, offset)
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        item = GGUFValueType(item)
        if item == GGUFValueType.STRING:
            _, end = _walk_strings(buf, offset, count)
            return StringArray(buf, offset, count), end
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            return np.frombuffer(buf, dtype, count, offset).tolist(), offset + dtype.itemsize * count
        values = []                                        # arrays of arrays: rare, small
        for _ in range(count):
            v, offset = self._value(buf, offset, item)
            values.append(v)
        return values, offset
