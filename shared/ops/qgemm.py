"""Block-quantised weights kept packed, multiplied by a C kernel that reads the codes (qgemm.c).

A 4-bit model exists for speed: decode reads every weight once a step, so a step's time follows the bytes read.
The formats Upesi serves (NVFP4; GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) all reduce to one form
(shared.ops.block_quant.BlockQuant). A QWeight lays it out once at load in the order the kernel streams
(shared.ops.qgemm_layout); the kernel expands the codes in registers and multiplies them with vdpbf16ps, or on AMX
tiles where the CPU has them (qgemm_amx.c), scaling each block's sum in fp32 (qgemm.c has the arithmetic). CPUs
without AVX512-BF16 but with AVX2 run fp32 rows through qgemm_avx2.c, which reads the same layout.

Exactness: with bf16 rows every product value * x is exact in fp32, so a row's result is the dequantised weight's
result up to the order of accumulation. fp32 rows are split into three bf16 parts (hi + mid + lo == x exactly),
run as three rows and added in fp32: the fp32 product up to accumulation order, at three rows' cost. The AVX2
kernel multiplies fp32 rows directly (fp32 products, fp32 sums). The torch reference is `BlockQuant.dequantise`
(the weight the file describes) with F.linear (tests/unit/test_qgemm.py).

Built with shared.ops.c_build at first use; where none can run (neither AVX512-BF16 nor AVX2 + FMA + F16C, no
compiler, UPESI_QGEMM=0, a self-check that disagrees) `available()` is False and callers keep a dequantised copy.
Shapes: M = rows, K = in features, N = out features, B = K / block, U = units of 32 columns.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.ops import c_build, qgemm_avx2
from shared.ops.block_quant import BlockQuant, QuantFormatError, example
from shared.ops.cpu_features import cpu_flags
from shared.ops.qgemm_weight import QWeight
from shared.ops.rows_gemm_bf16 import AMX_FLAGS, FLAGS, GEMM_ARGS

log = logging.getLogger(__name__)
WIDE_ROWS = 128           # bf16 calls of this many rows or more: dequantise for the call, then a bf16 matmul
FUSED_MAX_ROWS = 2048     # on AMX up to this many fused (1.2-1.7x at 256-1024 rows; a 2,000-row chunk 1.09x with the
                          # C decoder and SwiGLU fused into gate_up, even alone); AVX512-BF16's
                          # fused kernel at any count (1.33x at 128 rows, 1.08x at 512, 1.05-1.1x at 2048)

__all__ = ["BlockQuant", "QuantFormatError", "QWeight", "available", "example", "kernel_address", "linear", "run",
           "split_bf16"]

SOURCE = Path(__file__).with_suffix(".c")
AMX_SOURCE = SOURCE.with_name("qgemm_amx.c")              # compiled with the bf16 rows kernels' flags
WIDE_SOURCE = SOURCE.with_name("qgemm_amx_wide.c")
WIDE_AVX512_SOURCE = SOURCE.with_name("qgemm_wide.c")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if "avx512_bf16" not in cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_QGEMM", "quantised rows kernel")
    if lib is None:
        return None
    for fn in (lib.upesi_qgemm, lib.upesi_qgemm_f32):
        fn.argtypes, fn.restype = GEMM_ARGS, None
    lib.upesi_qgemm_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int]
    lib.upesi_qgemm_dequant.restype = None
    return lib


@functools.cache
def _amx_lib() -> ctypes.CDLL | None:
    """qgemm_amx.c where the CPU has AMX, the kernel grants its tile state and UPESI_AMX is not 0."""
    if not {"amx_tile", "amx_bf16"} <= cpu_flags() or os.environ.get("UPESI_AMX", "1") in ("0", "false", "no"):
        return None
    lib = c_build.load_or_none(AMX_SOURCE, AMX_FLAGS, "UPESI_QGEMM", "AMX quantised rows kernel")
    if lib is None:
        return None
    for fn in (lib.upesi_qgemm_amx, lib.upesi_qgemm_amx_f32):
        fn.argtypes, fn.restype = GEMM_ARGS, None
    lib.upesi_qgemm_amx_setup.restype = ctypes.c_int
    if lib.upesi_qgemm_amx_setup() != 0:
        log.warning("the kernel refused this process AMX's tile state; quantised layers use AVX512-BF16")
        return None
    return lib


@functools.cache
def _wide_fn() -> ctypes._CFuncPtr | None:
    """The fused dequantise-GEMM's bf16 call of this machine's quantised kernel (qgemm_amx_wide.c beside AMX's,
    qgemm_wide.c beside AVX512-BF16's) where it agrees with the dequantised weight's matmul; else None (wide calls
    dequantise, then call torch)."""
    name = kernel_name()
    if name == "amx":                                     # its library has asked for the AMX tile state
        lib = c_build.load_or_none(WIDE_SOURCE, AMX_FLAGS, "UPESI_QGEMM", "AMX fused dequantise-GEMM")
        fn = None if lib is None else lib.upesi_qgemm_amx_wide
    elif name == "avx512-bf16":
        lib = c_build.load_or_none(WIDE_AVX512_SOURCE, FLAGS, "UPESI_QGEMM", "fused dequantise-GEMM")
        fn = None if lib is None else lib.upesi_qgemm_wide
    else:
        return None
    if fn is None:
        return None
    fn.argtypes, fn.restype = GEMM_ARGS, None
    g = torch.Generator().manual_seed(0)
    for kind, block, has_min in (("u4", 32, True), ("e2m1", 16, False), ("nvfp4", 16, False), ("u6", 16, True),
                                 ("i8", 32, False)):
        w = QWeight(example(kind, 40, 96, block, g, has_min))
        x = torch.randn(21, 96, generator=g).bfloat16()
        weight = w.dequantise().t() if w.exact_bf16 else dequantise_bf16(w).float()   # exact ones stay unrounded
        want = x.float() @ weight
        if not torch.allclose(_call(x, w, None, torch.bfloat16, (fn, fn)).float(), want, rtol=2e-2, atol=2e-2):
            log.warning("fused dequantise-GEMM disagrees with its reference here; prefills dequantise instead")
            return None
    return fn


def _call(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None, out: torch.dtype,
          fns: tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None = None) -> torch.Tensor:
    """x [M, K] bf16 (features contiguous) -> [M, N] in `out` (bf16 or fp32)."""
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=out)
    if m:
        fn = (fns or _kernels())[0 if out == torch.bfloat16 else 1]
        fn(x.data_ptr(), m, x.stride(0), w.in_features, w.desc.data_ptr(),
           None if bias is None else bias.data_ptr(), w.out_features, y.data_ptr(), w.out_features,
           torch.get_num_threads())
    return y


def fused_max_rows() -> int:
    """The most rows a call multiplies fused (the rest dequantise, then torch's matmul): FUSED_MAX_ROWS on AMX,
    any count on AVX512-BF16."""
    return FUSED_MAX_ROWS if kernel_name() == "amx" else 1 << 62


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [3, M, K] bf16 whose sum is x exactly (hi, mid, lo; each the rounded remainder)."""
    hi = x.bfloat16()
    r = x - hi.float()
    mid = r.bfloat16()
    lo = (r - mid.float()).bfloat16()
    return torch.stack((hi, mid, lo))


def dequantise_bf16(w: QWeight) -> torch.Tensor:
    """W^T [K, N] bf16: the weight dequantised in C, each value rounded once to bf16 (its reference:
    w.dequantise().t().bfloat16(), up to the fused multiply-add's last bit before that rounding)."""
    wt = torch.empty(w.in_features, w.out_features, dtype=torch.bfloat16)
    _lib().upesi_qgemm_dequant(w.desc.data_ptr(), w.out_features, wt.data_ptr(), w.out_features,
                               torch.get_num_threads())
    return wt


def run(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 or fp32 on CPU -> x @ W^T (+ bias) [M, N] in x's dtype. bf16 calls of WIDE_ROWS rows or more
    (a prefill's chunk) multiply the weight dequantised to bf16: fused, unit by unit (qgemm_amx_wide.c on AMX up to
    FUSED_MAX_ROWS rows, qgemm_wide.c on AVX512-BF16), else dequantised for the call and multiplied with
    torch's bf16 matmul; their results then round each weight to bf16 once, as a bf16 copy of the weight would
    (the fused kernels keep exact weights, `QWeight.exact_bf16`, unrounded: on AMX those rows equal the narrow
    kernel's bit for bit).
    Without the AVX512-BF16 kernels every call takes the AVX2 fp32 path."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if _kernels() is None:
        return qgemm_avx2.linear_f32(x.float(), w, bias).to(x.dtype)
    if x.dtype == torch.bfloat16 and x.shape[0] >= WIDE_ROWS:
        wide = _wide_fn() if w.in_features % 32 == 0 and x.shape[0] <= fused_max_rows() else None
        if wide is not None:
            return _call(x, w, None if bias is None else bias.to(torch.bfloat16).contiguous(), x.dtype, (wide, wide))
        y = x @ dequantise_bf16(w)
        return y if bias is None else y + bias.to(torch.bfloat16)
    if x.dtype == torch.bfloat16:
        return _call(x, w, None if bias is None else bias.to(torch.bfloat16).contiguous(), torch.bfloat16)
    m = x.shape[0]
    parts = split_bf16(x.float()).view(3 * m, -1)
    y = _call(parts, w, None, torch.float32).view(3, m, -1)
    y = (y[0] + y[1]) + y[2]
    return y if bias is None else y + bias.float()


def linear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N]: the kernel for CPU rows (bf16; fp32; fp16 through the fp32 path),
    else F.linear on a dequantised copy (autograd, other devices)."""
    if x.dtype == torch.float32 and x.is_cpu and _avx2_ok() and not (x.requires_grad and torch.is_grad_enabled()):
        return qgemm_avx2.linear_f32(x, w, bias)
    if (x.device.type != "cpu" or not x.dtype.is_floating_point or not available()
            or (torch.is_grad_enabled() and x.requires_grad)):
        return F.linear(x, w.dequantise().to(device=x.device, dtype=x.dtype), bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, w.in_features)
    if x.dtype not in (torch.bfloat16, torch.float32):
        return run(rows.float(), w, None if bias is None else bias.float()).to(x.dtype).view(*lead, w.out_features)
    return run(rows, w, bias).view(*lead, w.out_features)


def _agrees(fns: tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]) -> bool:
    """Whether the kernels `fns` (bf16 and fp32 output) agree with the reference on every path, with and without
    mins, a partial unit of columns, a partial group of rows, and give a row alone the bits it has among others."""
    g = torch.Generator().manual_seed(0)
    for kind, block, has_min in (("u4", 32, True), ("e2m1", 16, False), ("nvfp4", 16, False), ("u6", 16, True),
                                 ("i8", 32, False)):
        n, k, m = 40, 96, 21
        bq = example(kind, n, k, block, g, has_min)
        w = QWeight(bq)
        x = torch.randn(m, k, generator=g).bfloat16()
        got = _call(x, w, None, torch.float32, fns)
        want = x.float() @ bq.dequantise().t()
        if not (torch.allclose(got, want, rtol=1e-4, atol=1e-3)
                and torch.equal(_call(x[m - 1:], w, None, torch.float32, fns), got[m - 1:])
                and torch.equal(_call(x, w, None, torch.bfloat16, fns), got.bfloat16())):
            return False
    return True


@functools.cache
def _kernels() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """This machine's quantised GEMMs (bf16 and fp32 output): AMX's where they run and agree with the reference,
    else AVX512-BF16's where those agree, else None."""
    if _lib() is None:
        return None
    amx = _amx_lib()
    if amx is not None:
        fns = (amx.upesi_qgemm_amx, amx.upesi_qgemm_amx_f32)
        if _agrees(fns):
            return fns
        log.warning("AMX quantised kernel disagrees with its reference on this machine; using AVX512-BF16")
    fns = (_lib().upesi_qgemm, _lib().upesi_qgemm_f32)
    if _agrees(fns):
        return fns
    log.warning("quantised rows kernel disagrees with its reference on this machine; dequantising instead")
    return None


@functools.cache
def _avx2_ok() -> bool:
    """The AVX2 kernel serves this machine: no AVX512-BF16 kernel, and it builds, loads and agrees."""
    return _kernels() is None and qgemm_avx2.works()


def available() -> bool:
    """True where a quantised kernel builds, loads and agrees with the reference on this machine."""
    return _kernels() is not None or _avx2_ok()


def kernel_name() -> str | None:
    """Which kernel multiplies packed weights here: "amx", "avx512-bf16", "avx2" or None."""
    fns = _kernels()
    if fns is not None:
        return "amx" if _amx_lib() is not None and fns[0] == _amx_lib().upesi_qgemm_amx else "avx512-bf16"
    return "avx2" if _avx2_ok() else None


def wide_kernel_address() -> int:
    """The address of the fused dequantise-GEMM that run() calls for a bf16 chunk of WIDE_ROWS rows or more, for C
    callers (decoder_bf16.c); 0 where none runs here (those rows dequantise, then torch's matmul)."""
    fn = _wide_fn() if _kernels() is not None else None
    return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def wide_swiglu_address() -> int:
    """The address of qgemm_amx_wide.c's gate_up GEMM that writes SwiGLU's activation itself (the wide GEMM and
    then decoder_bf16's silu_mul, bit for bit), for decoder_bf16.c; 0 where the wide GEMM is not AMX's."""
    if kernel_name() != "amx" or not wide_kernel_address():
        return 0
    lib = c_build.load_or_none(WIDE_SOURCE, AMX_FLAGS, "UPESI_QGEMM", "AMX fused dequantise-GEMM")
    return 0 if lib is None else ctypes.cast(lib.upesi_qgemm_amx_wide_swiglu, ctypes.c_void_p).value


def kernel_address() -> int:
    """The address of this machine's bf16 quantised GEMM, for C callers (decoder_bf16.c); requires the AVX512-BF16
    kernels (decoder_bf16 runs only where they do)."""
    return ctypes.cast(_kernels()[0], ctypes.c_void_p).value
