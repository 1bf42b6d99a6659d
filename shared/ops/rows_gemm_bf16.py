"""bf16 linear layers for a step's few rows, prepacked for CPUs with AVX512-BF16 (rows_gemm_bf16.c).

A decode step of the default model reads 270 MB of bf16 weights; at one to a few rows every linear layer is a
matrix-vector product bound by memory bandwidth. The kernel streams each weight once per call in panels of 16
output columns laid out for vdpbf16ps (pairs of input features side by side) and keeps up to 6 rows by 64 columns
of fp32 accumulators in registers. Every output is summed over the input features in one fixed order, so a row's
result does not depend on the other rows of the call: a verification row is computed exactly as a decode row.
Not bit-identical to oneDNN (another summation order); checked against an fp32 reference and F.linear.

Compiled at first use by shared.ops.c_build (-mavx512bf16) and loaded with ctypes. Where it cannot run (no
avx512_bf16 flag, no compiler, UPESI_ROWS_GEMM=0, a self-check that disagrees) `available()` is False and bf16
linear layers stay on oneDNN (shared.ops.packed_linear).

On CPUs with AMX (amx_bf16) oneDNN's tile multiplies make a matmul's cost nearly flat in its rows: streaming the
default model's 121 linear layers took 10-11 ms at 1 to 16 rows and 13 ms at 32 there, against this kernel's
8.0 ms at 1 row, 10 at 4, 14 at 9 and 38 at 32 (docs/performance.md). There a RowsWeightBF16 also keeps oneDNN's
prepacked copy and calls with more than `amx_rows()` rows (verifications, batches, prefills) take it (twice the
weights' memory; UPESI_AMX=0 keeps only the panels). Shapes: M = rows, K = in features, N = out features, KK = K / 2,
P = panels.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
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
MAX_ROWS = 64                 # the fused decoder's limit where there is no AMX (a batch of up to 64 decodes)
AMX_ROWS = 9                  # with AMX: more rows than this go to oneDNN (a 9-row verification stays)


@functools.cache
def _amx() -> bool:
    if "amx_bf16" not in cpu_flags() or os.environ.get("UPESI_AMX", "1") in ("0", "false", "no"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def amx_rows() -> int | None:
    """The most rows this kernel takes where oneDNN has AMX (more go to oneDNN's prepacked copy), or None where
    every call stays here (no AMX, UPESI_AMX=0, no oneDNN packing)."""
    return AMX_ROWS if _amx() else None


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
    """An [N, K] bf16 weight in this kernel's panels for `rows_linear`, and where AMX runs (`amx_rows`) oneDNN's
    prepacked copy for calls with more rows."""
    pack, unpack = staticmethod(pack), staticmethod(unpack)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if amx_rows() else None

    @property
    def nbytes(self) -> int:
        """The panels' bytes, plus the weight's for oneDNN's copy where there is one."""
        copy = self.out_features * self.in_features * 2 if self.onednn is not None else 0
        return self.panels.numel() * self.panels.element_size() + copy


def rows_linear(x: torch.Tensor, w: RowsWeightBF16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] bf16; autograd or another dtype or device: F.linear on a copy."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, w.weight.to(x.dtype), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if w.onednn is not None and x2.shape[0] > AMX_ROWS:
        y = torch.ops.mkldnn._linear_pointwise(x2, w.onednn, None if bias is None else bias.to(torch.bfloat16),
                                               "none", [], "")
        return y.view(*lead, w.out_features)
    return run(x2, w.panels, w.out_features, bias).view(*lead, w.out_features)
