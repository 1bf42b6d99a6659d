"""fp32 rows times packed weights on CPUs with AVX2 + FMA + F16C and no AVX512-BF16 (qgemm_avx2.c).

The kernel reads the same layout as qgemm.c (QWeight) and multiplies fp32 rows directly: fp32 products, fp32 sums,
so the result is x @ W^T for the dequantised weight up to accumulation order, and a row's bits do not depend on the
rows beside it. Calls of WIDE_ROWS_F32 rows or more dequantise the weight in C for the call (bit for bit
`QWeight.dequantise`) and use torch's fp32 matmul. Shapes: M = rows, K = in features, N = out features.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.ops import c_build
from shared.ops.block_quant import example
from shared.ops.cpu_features import cpu_flags
from shared.ops.qgemm_weight import QWeight
from shared.ops.rows_gemm_bf16 import GEMM_ARGS

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
WIDE_ROWS_F32 = 256       # calls of this many rows or more: the weight dequantised to fp32 for the call


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """qgemm_avx2.c where the CPU has AVX2, FMA and F16C and it builds (UPESI_QGEMM not 0)."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_QGEMM", "AVX2 quantised rows kernel")
    if lib is None:
        return None
    lib.upesi_qgemm_avx2.argtypes, lib.upesi_qgemm_avx2.restype = GEMM_ARGS, None
    lib.upesi_qgemm_avx2_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_int]
    lib.upesi_qgemm_avx2_dequant.restype = None
    return lib


def call(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 with evenly spaced rows (2-D with features contiguous, or contiguous), bias [N] fp32 or None
    -> [..., N] fp32 through qgemm_avx2.c, whatever the row count."""
    m = x.numel() // w.in_features
    y = torch.empty(*x.shape[:-1], w.out_features)
    if m:
        _lib().upesi_qgemm_avx2(x.data_ptr(), m, x.stride(-2) if x.dim() > 1 else w.in_features,
                                w.in_features, w.desc_ptr, None if bias is None else bias.data_ptr(),
                                w.out_features, y.data_ptr(), w.out_features, torch.get_num_threads())
    return y


_scratch = threading.local()
SCRATCH_MAX = 1 << 23     # floats (32 MiB) a thread keeps for dequantised weights; bigger ones (an LM head) are fresh


def dequantise_f32(w: QWeight, reuse: bool = False) -> torch.Tensor:
    """W [N, K] fp32 dequantised in C, bit for bit `w.dequantise()`. reuse: into this thread's scratch buffer (up to
    SCRATCH_MAX floats), valid until its next such call (a prefill's linears one after another: no fresh pages for
    every call)."""
    size = w.out_features * w.in_features
    if reuse and size <= SCRATCH_MAX:
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < size:
            buf = _scratch.buf = torch.empty(size, dtype=torch.float32)
        out = buf[:size].view(w.out_features, w.in_features)
    else:
        out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
    _lib().upesi_qgemm_avx2_dequant(w.desc.data_ptr(), w.out_features, out.data_ptr(), w.in_features,
                                    torch.get_num_threads())
    return out


def linear_f32(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 rows on the kernel, with as little around the C call as a decode step's hundred-odd calls want:
    x [..., K] -> [..., N] fp32. WIDE_ROWS_F32 rows or more (a prefill's chunk) multiply the weight dequantised for
    the call with torch's fp32 matmul, which is faster there."""
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    if x.numel() >= WIDE_ROWS_F32 * w.in_features:
        return F.linear(x, dequantise_f32(w, reuse=True), bias)
    return call(x, w, bias)


def _agrees() -> bool:
    """Whether the kernel agrees with the reference on every expansion path (partial units and row tiles), gives
    a row alone the bits it has among others, and dequantises bit for bit as the layout's unpack."""
    g = torch.Generator().manual_seed(0)
    for kind, block, has_min in (("u4", 32, True), ("e2m1", 16, False), ("u6", 16, True), ("i8", 32, False)):
        n, k, m = 40, 96, 7
        bq = example(kind, n, k, block, g, has_min)
        w = QWeight(bq)
        x = torch.randn(m, k, generator=g)
        got = call(x, w)
        if not (torch.allclose(got, x @ bq.dequantise().t(), rtol=1e-4, atol=1e-4)
                and torch.equal(call(x[m - 1:], w), got[m - 1:])
                and torch.equal(dequantise_f32(w), w.dequantise())):
            return False
    return True


@functools.cache
def works() -> bool:
    """The kernel builds, loads and agrees with its reference on this machine."""
    if _lib() is None:
        return False
    if _agrees():
        return True
    log.warning("AVX2 quantised rows kernel disagrees with its reference on this machine; dequantising instead")
    return False


def kernel_address() -> int:
    """The address of upesi_qgemm_avx2, for C callers (decoder_f32.c); requires `works()`."""
    return ctypes.cast(_lib().upesi_qgemm_avx2, ctypes.c_void_p).value
