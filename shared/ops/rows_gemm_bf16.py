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

On CPUs with AMX (amx_tile and amx_bf16) every call takes rows_gemm_amx.c instead: the same panels, read as AMX
tiles (16 pairs of input features by 16 columns), with tdpbf16ps accumulating 16 rows by 16 columns at a time.
Its cost is nearly flat in the rows: the default model's 121 linear layers streamed in 9.3 ms at 1 row, 9.7 at 9,
12.1 at 32 and 16.1 at 64 (this kernel 9.6 / 17.1 / 47.3 / 92.1, oneDNN's AMX kernels 13.8 / - / 16.7 / 19.9;
docs/performance.md). Its rows are independent of each other too, but its sums are in another order than this
kernel's, so one machine uses one of them for every call (UPESI_AMX=0 keeps this one).
Shapes: M = rows, K = in features, N = out features, KK = K / 2, P = panels.
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
AMX_SOURCE = SOURCE.with_name("rows_gemm_amx.c")
AMX_FLAGS = FLAGS + ["-mamx-tile", "-mamx-bf16"]
PANEL, TILE = 16, 64          # output columns per panel; per tile of 4 panels (N is padded to a multiple)
MAX_ROWS = 64                 # the fused decoder's limit (a batch of up to 64 decodes)
# the rows GEMM's call (x, m, ldx, k, weight, bias, n, y, ldy, threads), which shared.ops.qgemm's kernels share
GEMM_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if "avx512_bf16" not in cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_ROWS_GEMM", "bf16 rows kernel")
    if lib is None:
        return None
    lib.upesi_rows_gemm_bf16.argtypes, lib.upesi_rows_gemm_bf16.restype = GEMM_ARGS, None
    return lib


@functools.cache
def _amx_lib() -> ctypes.CDLL | None:
    """rows_gemm_amx.c where the CPU has AMX, the kernel may ask for its tile state and UPESI_AMX is not 0; its
    calls with K not a multiple of 32 take rows_gemm_bf16.c."""
    if not {"amx_tile", "amx_bf16"} <= cpu_flags() or os.environ.get("UPESI_AMX", "1") in ("0", "false", "no"):
        return None
    lib = c_build.load_or_none(AMX_SOURCE, AMX_FLAGS, "UPESI_ROWS_GEMM", "AMX rows kernel")
    if lib is None:
        return None
    lib.upesi_rows_gemm_amx.argtypes, lib.upesi_rows_gemm_amx.restype = GEMM_ARGS, None
    lib.upesi_amx_setup.argtypes, lib.upesi_amx_setup.restype = [ctypes.c_void_p], ctypes.c_int
    if lib.upesi_amx_setup(ctypes.cast(_lib().upesi_rows_gemm_bf16, ctypes.c_void_p)) != 0:
        log.warning("the kernel refused this process AMX's tile state; using AVX512-BF16")
        return None
    return lib


def _agrees(fn: ctypes._CFuncPtr) -> bool:
    """Whether `fn` agrees with an fp32 reference on every row count of a tile and a partial tile of columns,
    for K a multiple of 32 and not, and gives a row alone the bits it has among others."""
    g = torch.Generator().manual_seed(0)
    for n, k, m in ((72, 40, 13), (72, 64, 20), (130, 96, 40)):
        w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
        want = (x.float() @ w.float().t()).bfloat16()
        got = _call(fn, x, pack(w), n, None)
        if not (torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
                and torch.equal(_call(fn, x[m - 1:], pack(w), n, None), got[m - 1:])):
            return False
    return True


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    """The C function every bf16 rows call takes on this machine: AMX's where it runs and agrees with the
    reference, else AVX512-BF16's where that agrees, else None."""
    if _lib() is None:
        return None
    amx = _amx_lib()
    if amx is not None:
        if _agrees(amx.upesi_rows_gemm_amx):
            return amx.upesi_rows_gemm_amx
        log.warning("AMX rows kernel disagrees with the fp32 reference on this machine; using AVX512-BF16")
    if _agrees(_lib().upesi_rows_gemm_bf16):
        return _lib().upesi_rows_gemm_bf16
    log.warning("bf16 rows kernel disagrees with the fp32 reference on this machine; using oneDNN")
    return None


def available() -> bool:
    """True where a bf16 rows kernel builds, loads and agrees with an fp32 reference."""
    return _kernel() is not None


def uses_amx() -> bool:
    """Whether this machine's bf16 rows calls take the AMX kernel."""
    return available() and _amx_lib() is not None and _kernel() is _amx_lib().upesi_rows_gemm_amx


def kernel_address() -> int:
    """The address of this machine's rows GEMM, for C callers (decoder_bf16.c); requires available()."""
    return ctypes.cast(_kernel(), ctypes.c_void_p).value


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
    return _call(_kernel(), x, panels, n, bias)


def _call(fn: ctypes._CFuncPtr, x: torch.Tensor, panels: torch.Tensor, n: int,
          bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        fn(x.data_ptr(), m, x.stride(0), k, panels.data_ptr(), None if bias is None else bias.data_ptr(), n,
           y.data_ptr(), n, torch.get_num_threads())
    return y


class RowsWeightBF16(RowsWeight):
    """An [N, K] bf16 weight in this kernel's panels for `rows_linear` (the AMX kernel reads the same panels)."""
    pack, unpack = staticmethod(pack), staticmethod(unpack)


def rows_linear(x: torch.Tensor, w: RowsWeightBF16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] bf16; autograd or another dtype or device: F.linear on a copy."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, w.weight.to(x.dtype), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    return run(x2, w.panels, w.out_features, bias).view(*lead, w.out_features)
