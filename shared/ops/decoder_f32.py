"""The decoder stack in one C call for fp32 rows on AVX2 CPUs whose linears are block-quantised (decoder_f32.c), and
SwiGLU's silu(gate) * up in C for fp32 rows there.

On a CPU without AVX512-BF16 the services run fp32, and the default model's layers stay packed (qgemm_avx2.c). A
batch-1 step then makes about a dozen Python-level calls a layer, each costing several microseconds of dispatch on
such machines, as much again as the GEMMs stream. `shared.ops.decoder_bf16.DecoderStack` with fp32 layers makes the
same kernel calls from C through `upesi_decoder_f32`, in the same order, so its result equals the module path's
bit for bit (tests/unit/test_decoder_stack.py); `silu_mul` is the activation of both paths, its reference torch's
F.silu(gate) * up, which it matches to about an ulp.

Built with shared.ops.c_build at first use; it runs where the AVX2 quantised kernel serves (qgemm.kernel_name()
is "avx2"); UPESI_CPU_DECODER=0 or a failed build leave the module path and torch's activation.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from shared.ops import c_build, cpu_attention, qgemm, rms_norm

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if qgemm.kernel_name() != "avx2":
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_CPU_DECODER", "fp32 CPU decoder kernel")
    if lib is None:
        return None
    lib.upesi_silu_mul_f32.argtypes = [_P, _I, _I, _I, _P, ctypes.c_int]
    lib.upesi_decoder_f32.argtypes = [_P, _P, _P, _F, _F, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _P, _I]
    for fn in (lib.upesi_silu_mul_f32, lib.upesi_decoder_f32):
        fn.restype = None
    return lib


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] fp32 on CPU (gate, then up; features contiguous) -> silu(gate) * up [T, I]; needs _lib()."""
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    two_i = x.shape[-1]
    out = torch.empty(x.shape[0], two_i // 2)
    if x.shape[0]:
        _lib().upesi_silu_mul_f32(x.data_ptr(), x.shape[0], x.stride(0), two_i // 2, out.data_ptr(),
                                  torch.get_num_threads())
    return out


def takes_silu(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul` runs these rows: 2-D fp32 on CPU, no autograd, on a machine where the library runs."""
    return (gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.device.type == "cpu"
            and not (torch.is_grad_enabled() and gate_up.requires_grad) and _lib() is not None)


@functools.cache
def available() -> bool:
    """True where this library and every kernel it calls run on this machine."""
    return _lib() is not None and rms_norm.available() and cpu_attention.available()
