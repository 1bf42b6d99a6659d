"""RMSNorm on CPU in C (rms_norm.c): one call instead of the torch path's six small ops per norm.

A decode step of the default model runs 61 norms; each is a handful of tiny tensor ops whose dispatch costs more
than their arithmetic; the C call costs a fraction of that (docs/performance.md). The reference is the
torch path of shared.model.llama.RMSNorm (tests/unit/test_rms_norm.py); results agree to the last bit or two of
the sum of squares (another summation order). Built with shared.ops.c_build at first use; UPESI_CPU_NORM=0, no
compiler or a failed self-check leave the torch path. `add_rms_norm` is the residual add and the norm after it in
one pass (a prefill's rows cross memory once instead of three times). Shapes: T = rows, D = features (at most 8192).
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
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
MAX_D = 8192


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_CPU_NORM", "CPU RMSNorm kernel")
    if lib is None:
        return None
    lib.upesi_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.upesi_rms_norm.restype = None
    lib.upesi_add_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.upesi_add_rms_norm.restype = None
    lib.upesi_rms_norm_avx512.argtypes, lib.upesi_rms_norm_avx512.restype = [ctypes.c_int], ctypes.c_int
    return lib


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path (as Hugging Face's LlamaRMSNorm): fp32 statistics, the row rounded to x's dtype, times w."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@functools.cache
def available() -> bool:
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 100, generator=g), torch.randn(100, generator=g)
    ok = all(torch.allclose(rms_norm(x.to(dt), w.to(dt), 1e-5).float(), reference(x.to(dt), w.to(dt), 1e-5).float(),
                            rtol=1e-2 if dt == torch.bfloat16 else 1e-5, atol=1e-2 if dt == torch.bfloat16 else 1e-5)
             for dt in (torch.float32, torch.bfloat16))
    if not ok:
        log.warning("CPU RMSNorm kernel disagrees with torch on this machine; using torch")
    return ok


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16)
            and x.shape[-1] <= MAX_D and x.stride(-1) == 1 and not (torch.is_grad_enabled() and
                                                                    (x.requires_grad or weight.requires_grad))
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (features contiguous), weight [D] of x's dtype -> [..., D]."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d) if x.dim() != 2 else x
    y = torch.empty(x2.shape, dtype=x.dtype)
    if x2.shape[0]:
        _lib().upesi_rms_norm(x2.data_ptr(), x2.shape[0], x2.stride(0), d, weight.contiguous().data_ptr(), eps,
                              y.data_ptr(), int(x.dtype == torch.bfloat16))
    return y.view(x.shape)


def add_supports(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether add_rms_norm takes these: supports(x), and a of x's shape and dtype, both contiguous."""
    return (supports(x, weight) and a.shape == x.shape and a.dtype == x.dtype and a.device.type == "cpu"
            and x.is_contiguous() and a.is_contiguous() and not (torch.is_grad_enabled() and a.requires_grad))


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """x, a [..., D] -> (s, y): s = x + a in x's dtype (torch's add), y = rms_norm(s) [..., D]."""
    d = x.shape[-1]
    s, y = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        _lib().upesi_add_rms_norm(x.data_ptr(), a.data_ptr(), x.numel() // d, d, weight.contiguous().data_ptr(),
                                  eps, s.data_ptr(), y.data_ptr(), int(x.dtype == torch.bfloat16))
    return s, y


def use_avx512(on: bool) -> bool:
    """Chooses the kernel's AVX-512 path (where the CPU has it) or its AVX2 one; returns whether AVX-512 runs.
    Both give the same bits; the choice exists for tests."""
    return bool(_lib().upesi_rms_norm_avx512(int(on)))
