"""fp32 linear layers with their weights prepacked in panels, for CPUs with AVX2 + FMA (rows_gemm.c).

MKL, oneDNN and OpenBLAS run fp32 matmuls of the few rows of a decode or verification step at a fraction of an AVX2
core's peak, so that verifying K drafts cost more than speculation gained (figures: docs/benchmarks.md). The kernel
here reads each 16-column panel of the weight once per call and runs every row of x over it from cache (12
accumulators of 8 floats), which keeps 9 rows near the cost of one (bench/bench_matmul_rows.py: `f32-rows`). Every
output is summed over k in order, so a row's result does not depend on how many rows share the call: a verification
row is computed exactly as a decode row, and a prefill row too.

The C source is compiled at first use (gcc or cc, -O3 -mavx2 -mfma -fopenmp, under ~/.cache/upesi/kernels or
$UPESI_KERNEL_CACHE, keyed by the source's hash) and loaded with ctypes; it links the OpenMP runtime torch has
already loaded. Where it cannot run (no AVX2 / FMA, no compiler, a self-check that disagrees with F.linear, or
UPESI_ROWS_GEMM=0) `available()` is False and fp32 stays on F.linear. The torch reference is F.linear
(tests/unit/test_rows_gemm.py). Shapes: M = rows, K = in features, N = out features, P = ceil(N / 16) panels.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.ops import c_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
PANEL = 16                                            # output columns per panel (NR in the C source)
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_ROWS_GEMM", "fp32 rows kernel")
    if lib is None:
        return None
    fn = lib.upesi_rows_gemm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return lib


@functools.cache
def available() -> bool:
    """True where the kernel builds, loads and agrees with F.linear on a small case (every row tile size)."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    # 21 rows: tiles of 6, 6, 6 and 3; K = 300: three k-chunks of 128 (the last partial); N = 40: a partial panel.
    w, x = torch.randn(40, 300, generator=g), torch.randn(21, 300, generator=g)
    ok = torch.allclose(_run(x, pack(w), 40), F.linear(x, w), rtol=1e-4, atol=1e-4)
    if not ok:
        log.warning("fp32 rows kernel disagrees with F.linear on this machine; using F.linear")
    return ok


def packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.ndim == 2 and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [P, K, 16] panels (columns past N zero)."""
    n, k = weight.shape
    padded = weight.detach().new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = weight.detach()
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """[P, K, 16] -> the [N, K] weight, a contiguous copy (the panels interleave columns, so no view exists)."""
    p, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(p * PANEL, k)[:n]


def _run(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        _lib().upesi_rows_gemm(x.data_ptr(), m, k, panels.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    return y


class RowsWeight:
    """An [N, K] fp32 weight in panels for `rows_linear`; `weight` unpacks a copy for the rare reader (autograd,
    quantisation, other kernels). Not a tensor, so `.to()` and state_dict never see it."""
    pack, unpack = staticmethod(pack), staticmethod(unpack)

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.panels = self.pack(weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.unpack(self.panels, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def rows_linear(x: torch.Tensor, w: RowsWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in fp32. Falls back to F.linear on an unpacked copy where autograd
    needs it or x is not fp32 on CPU."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, w.weight, bias)
    lead = x.shape[:-1]
    y = _run(x.reshape(-1, w.in_features).contiguous(), w.panels, w.out_features)
    if bias is not None:
        y += bias
    return y.view(*lead, w.out_features)
