"""Greedy tokens on CPU in C (argmax.c): each fp32 row's first index of its maximum, as torch.argmax.

A batch of 32 greedy decodes picks its tokens from [32, 49152] fp32 logits; torch's reduction took 1.24 ms with
argmax and 0.45 ms with max over the last dim on 2 threads, about 3% of such a step (docs/performance.md). The
kernel reads each row twice (an 8-lane max, then the first lane equal to it) in a fraction of that. The
reference is `torch.Tensor.argmax` (tests/unit/test_argmax.py), ties and NaN included. Built with shared.ops.c_build
at first use; UPESI_CPU_ARGMAX=0, no compiler or a failed self-check leave torch's `max`.
Shapes: M = rows, V = vocabulary.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from shared.ops import c_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_CPU_ARGMAX", "CPU argmax kernel")
    if lib is None:
        return None
    lib.upesi_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int]
    lib.upesi_argmax_rows.restype = None
    return lib


@functools.cache
def available() -> bool:
    """True where the kernel builds, loads and gives torch's argmax on rows with ties, NaN and -inf."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (6, 37), generator=g).float()
    x[1, 20], x[2] = float("nan"), float("-inf")
    ok = torch.equal(_run(x), x.argmax(-1))
    if not ok:
        log.warning("CPU argmax kernel disagrees with torch on this machine; using torch")
    return ok


def _run(x: torch.Tensor) -> torch.Tensor:
    m, v = x.shape
    out = torch.empty(m, dtype=torch.int64)
    if x.stride(1) != 1:
        x = x.contiguous()
    _lib().upesi_argmax_rows(x.data_ptr(), m, x.stride(0), v, out.data_ptr(), torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] -> [M] int64, each row's first index of its maximum (of its first NaN, if it has one)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.ndim == 2 and x.shape[1] and available():
        return _run(x)
    return x.max(dim=-1).indices
