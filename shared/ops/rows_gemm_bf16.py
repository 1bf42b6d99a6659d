"""bf16 linear layers for a step's few rows, prepacked for CPUs with AVX512-BF16 (rows_gemm_bf16.c).

A decode step of the default model reads 270 MB of bf16 weights; at one to a few rows every linear layer is a
matrix-vector product bound by memory bandwidth. The kernel streams each weight once per call in panels of 16
output columns laid out for vdpbf16ps (pairs of input features side by side) and keeps up to 6 rows by 64 columns
of fp32 accumulators in registers. Every output is summed over the input features in one fixed order, so a row's
result does not depend on the other rows of the call: a verification row is computed exactly as a decode row.
Not bit-identical to oneDNN (another summation order); checked against an fp32 reference and F.linear.

Compiled at first use by shared.ops.c_build (-mavx512bf16) and loaded with ctypes. Where it cannot run (no
avx512_bf16 flag, no compiler, UPESI_ROWS_GEMM=0, a self-check that disagrees) `available()` is False and bf16
linear layers stay on oneDNN (shared.ops.packed_linear). Steps over more than MAX_ROWS rows (prefills) go to oneDNN,
whose blocking suits them better. Shapes: M = rows, K = in features, N = out features, KK = K / 2, P = panels.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.ops import c_build
from shared.ops.cpu_features import cpu_flags
from shared.ops.rows_gemm import RowsWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
PANEL, TILE = 16, 64          # output columns per panel; per tile of 4 panels (N is padded to a multiple)
MAX_ROWS = 24                 # more rows than this: oneDNN


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if "avx512_bf16" not in cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_ROWS_GEMM", "bf16 rows kernel")
    if lib is None:
        return None
    fn = lib.upesi_rows_gemm_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = None
    return lib


@functools.cache
def available() -> bool:
    """True where the kernel builds, loads and agrees with an fp32 reference on every row count of a tile and a
    partial tile of columns."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(72, 40, generator=g).bfloat16(), torch.randn(13, 40, generator=g).bfloat16()
    want = (x.float() @ w.float().t()).bfloat16()
    ok = torch.allclose(run(x, pack(w), 72).float(), want.float(), rtol=1e-2, atol=1e-2)
    if not ok:
        log.warning("bf16 rows kernel disagrees with the fp32 reference on this machine; using oneDNN")
    return ok


def packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.ndim == 2
            and weight.shape[1] % 2 == 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [P, KK, 32] panels, P a multiple of 4 (columns past N zero): panel p, pair kk holds
    (W[16p + l, 2kk], W[16p + l, 2kk + 1]) at 2l, 2l + 1."""
    n, k = weight.shape
    padded = weight.detach().new_zeros(-(-n // TILE) * TILE, k)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k // 2, 2).transpose(1, 2).reshape(-1, k // 2, 2 * PANEL).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """[P, KK, 32] -> the [N, K] weight (a copy)."""
    p, kk, _ = panels.shape
    return panels.view(p, kk, PANEL, 2).transpose(1, 2).reshape(p * PANEL, 2 * kk)[:n]


def run(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 (rows may be strided, features contiguous) (+ bias [N], added before the one rounding to
    bf16) -> [M, N] bf16."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        _lib().upesi_rows_gemm_bf16(x.data_ptr(), m, x.stride(0), k, panels.data_ptr(),
                                    None if bias is None else bias.data_ptr(), n, y.data_ptr(), n,
                                    torch.get_num_threads())
    return y


class RowsWeightBF16(RowsWeight):
    """An [N, K] bf16 weight in this kernel's panels for `rows_linear`."""
    pack, unpack = staticmethod(pack), staticmethod(unpack)


def rows_linear(x: torch.Tensor, w: RowsWeightBF16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] bf16; autograd or another dtype or device: F.linear on a copy."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, w.weight.to(x.dtype), bias)
    lead = x.shape[:-1]
    return run(x.reshape(-1, w.in_features), w.panels, w.out_features, bias).view(*lead, w.out_features)
