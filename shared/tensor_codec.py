"""Tensors on the wire: raw little-endian bytes with a dtype name and a shape.

No pickles and no protobuf here: callers put the triple into their own message (upesi.v1.Tensor). bfloat16 has no
numpy dtype, so it travels as its 16-bit pattern.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from shared.errors import InvalidRequest

# name -> (torch dtype, little-endian numpy dtype of the same bit pattern)
_FORMATS: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int64": (torch.int64, np.dtype("<i8")),
}
_NAMES = {tdt: name for name, (tdt, _) in _FORMATS.items()}
_BIT_VIEW = {torch.bfloat16: torch.int16}


class TensorFormatError(InvalidRequest):
    """Bytes, dtype and shape that do not make a tensor (a client's error: INVALID_ARGUMENT)."""


def encode(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor (any device) -> (dtype name, shape, little-endian bytes)."""
    name = _NAMES.get(t.dtype)
    if name is None:
        raise TensorFormatError(f"dtype {t.dtype} cannot go on the wire; use one of {sorted(_FORMATS)}")
    t = t.detach().contiguous().cpu()
    arr = t.view(_BIT_VIEW.get(t.dtype, t.dtype)).numpy()
    le = _FORMATS[name][1]
    return name, list(t.shape), arr.astype(le, copy=False).tobytes()    # no copy on little-endian hosts


def decode(dtype: str, shape: list[int] | tuple[int, ...], data: bytes) -> torch.Tensor:
    """(dtype name, shape, bytes) -> a new CPU tensor that owns its memory."""
    fmt = _FORMATS.get(dtype)
    if fmt is None:
        raise TensorFormatError(f"unknown tensor dtype {dtype!r}; expected one of {sorted(_FORMATS)}")
    tdt, le = fmt
    shape = tuple(int(s) for s in shape)
    want = math.prod(shape) * le.itemsize
    if len(data) != want:
        raise TensorFormatError(f"tensor of dtype {dtype} and shape {list(shape)} needs {want} bytes, got {len(data)}")
    arr = np.frombuffer(data, dtype=le).astype(le.newbyteorder("="))     # a writable native-order copy
    t = torch.from_numpy(arr).reshape(shape)
    return t.view(tdt) if tdt in _BIT_VIEW else t


def nbytes(shape: list[int] | tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _FORMATS[dtype][1].itemsize
