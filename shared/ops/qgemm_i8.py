"""Block-quantised weights times int8-quantised activations (W4A8 / W8A8): the opt-in approximate path.

The exact path (shared.ops.qgemm) expands every code to bf16 and multiplies in fp32; on one decode row that
expansion, not memory, bounds it. Here each row of x is quantised per block of the weight's 16 or 32 input features
to int8 (Q8_0's rule: step amax / 127, round half to even), and qgemm_i8.c multiplies the weight's integer codes by
those int8 values with AVX512-VNNI's vpdpbusd: exact integer block sums, then the block's scales in fp32. Rows
stay independent of each other, so a verification row equals its decode row bit for bit; the price is x's
quantisation error (about 2^-8 of each block's largest value), measured as perplexity by bench/bench_nvfp4.py.

`QWeightI8` lays a BlockQuant out once (qgemm_i8.c describes the record); `linear` runs it (calls of WIDE_ROWS rows
or more, a prefill's chunks, multiply bf16 activations by the weight dequantised for the call); `reference` is the
same arithmetic in float64 torch from the BlockQuant, which tests/unit/test_qgemm_i8.py holds the kernel to. Built with
shared.ops.c_build at first use; where it cannot run (no AVX512-VNNI or AVX512-BF16, no compiler, UPESI_QGEMM_I8=0)
`available()` is False and callers keep the exact path.
Shapes: M = rows, K = in features, N = out features, NB = K / F, U = units of 16 columns.
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
from shared.ops.block_quant import BlockQuant, QuantFormatError
from shared.ops.cpu_features import cpu_flags
from shared.ops.rows_gemm_bf16 import GEMM_ARGS

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-int8",
         "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]    # AMX instructions run only after the setup call
COLS = 16
WIDE_ROWS = 128           # calls of this many rows or more (prefill chunks): dequantise for the call, bf16 matmul


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if not {"avx512_vnni", "avx512_bf16"} <= cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_QGEMM_I8", "int8-activation quantised kernel")
    if lib is None:
        return None
    for fn in (lib.upesi_qgemm_i8, lib.upesi_qgemm_i8_f32):
        fn.argtypes, fn.restype = GEMM_ARGS, None
    lib.upesi_qgemm_i8_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int]
    lib.upesi_qgemm_i8_dequant.restype = None
    lib.upesi_qgemm_i8_amx_setup.restype = ctypes.c_int
    if {"amx_tile", "amx_int8"} <= cpu_flags() and os.environ.get("UPESI_AMX", "1") not in ("0", "false", "no"):
        if lib.upesi_qgemm_i8_amx_setup() != 0:
            log.info("the kernel refused this process AMX's tile state; int8 activations run on AVX512-VNNI only")
    return lib


def available() -> bool:
    """Whether the W4A8 / W8A8 kernel runs on this CPU."""
    return _lib() is not None


def kernel_address() -> int:
    """The bf16-output kernel's address, for the fused decoder stack (shared.ops.decoder_bf16)."""
    return ctypes.cast(_lib().upesi_qgemm_i8, ctypes.c_void_p).value


def _integer_form(bq: BlockQuant) -> tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor]:
    """(codes [N, K] uint8 as stored, the 16-entry code -> u table or None, off, scales [N, NB]): the weight as
    (u - off) * scales (+ mins), u in 0 .. 255."""
    if bq.bits == 4:
        lut = bq.lut.float()
        f = 1.0 if torch.equal(lut, lut.round()) else 2.0
        tv = lut * f
        if not torch.equal(tv, tv.round()) or tv.min() < -128 or tv.max() > 127:     # the tiles' codes are int8
            raise QuantFormatError("a 4-bit table that is not int8 integers or halves has no int8 form")
        off = int(-min(tv.min().item(), 0.0))
        return bq.codes.to(torch.uint8), (tv + off).to(torch.uint8), off, bq.scales / f
    off = int(-min(int(bq.codes.min()), 0))
    return (bq.codes.int() + off).to(torch.uint8), None, off, bq.scales


def _fits_f16(t: torch.Tensor) -> bool:
    return torch.equal(t.half().float(), t)


def _per_unit(t: torch.Tensor, units: int, f16: bool) -> torch.Tensor:
    """[N, NB] fp32 -> [U, NB, 16 * (2 | 4)] bytes, the unit's 16 columns side by side per block."""
    n, nb = t.shape
    t = F.pad(t, (0, 0, 0, units * COLS - n)).to(torch.float16 if f16 else torch.float32)
    return t.view(units, COLS, nb).transpose(1, 2).contiguous().view(torch.uint8).view(units, nb, -1)


class QWeightI8:
    """An [N, K] block-quantised weight laid out for qgemm_i8.c (times an optional per-column factor colf [N])."""
    kind = "int8 activations"                    # what a layer's repr names (QWeight's is its expansion path)

    def __init__(self, bq: BlockQuant, colf: torch.Tensor | None = None) -> None:
        n, k = bq.shape
        if bq.block not in (16, 32) or k % bq.block or bq.bits not in (4, 8):
            raise QuantFormatError(f"cannot pack a [{n}, {k}] weight of {bq.bits}-bit codes in blocks of {bq.block}")
        self.out_features, self.in_features, self.block = n, k, bq.block
        codes, table, off, scales = _integer_form(bq)
        nb, units, f = k // bq.block, -(-n // COLS), bq.block
        c = F.pad(codes, (0, 0, 0, units * COLS - n)).view(units, COLS, nb, f // 4, 4)
        c = c.permute(0, 2, 3, 1, 4).contiguous().view(units, nb, f // 4, 64)          # vector j: [16 cols x 4]
        if table is not None:
            pairs = c.view(units, nb, f // 8, 2, 64)
            c = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)                           # vectors 2L, 2L+1: nibbles
        sf16 = _fits_f16(scales)
        mf16 = bq.mins is not None and _fits_f16(bq.mins)
        parts = [c.reshape(units, nb, -1), _per_unit(scales, units, sf16)]
        if bq.mins is not None:
            parts.append(_per_unit(bq.mins, units, mf16))
        self.data = torch.cat(parts, dim=-1).contiguous()                              # [U, NB, record]
        self.lut = (table if table is not None else torch.zeros(16, dtype=torch.uint8)).contiguous()
        self.colf = None if colf is None else F.pad(colf.float(), (0, units * COLS - n)).contiguous()
        self.desc = torch.tensor([self.data.data_ptr(), self.lut.data_ptr(), int(table is not None), f, nb,
                                  self.data.shape[-1], off, int(sf16), int(bq.mins is not None), int(mf16),
                                  0 if self.colf is None else self.colf.data_ptr()], dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.colf is None else self.colf.numel() * 4)

    def dequantise_t(self) -> torch.Tensor:
        """[K, N] bf16 from the packed form: ((u - off) * scale + min) * colf, rounded once."""
        wt = torch.empty(self.in_features, self.out_features, dtype=torch.bfloat16)
        _lib().upesi_qgemm_i8_dequant(self.desc.data_ptr(), self.out_features, wt.data_ptr(), wt.stride(0),
                                      torch.get_num_threads())
        return wt

    def dequantise(self) -> torch.Tensor:
        """[N, K] fp32 (from the bf16 rounding of dequantise_t: the reader of a head's rows, autograd)."""
        return self.dequantise_t().t().float()


def pack(bq: BlockQuant, colf: torch.Tensor | None = None) -> QWeightI8 | None:
    """`bq` laid out for this kernel, or None where it does not run here or cannot hold the codes as int8."""
    if not available():
        return None
    try:
        return QWeightI8(bq, colf)
    except QuantFormatError:
        return None


def weight_of(bq: BlockQuant, colf: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] fp32: the weight a QWeightI8 of (bq, colf) multiplies by, from the BlockQuant itself."""
    w = bq.dequantise()
    return w if colf is None else w * colf.float()[:, None]


def quantise_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 values) -> (q [M, K] int8 values as fp32, step [M, K / block]): the kernel's rule."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)                                           # [M, NB, 1]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = torch.full_like(safe, 127.0) / safe                  # a true division, as C's (127 / t is a reciprocal)
    q = torch.where(amax > 0, torch.round(xb * inv), torch.zeros_like(xb))
    return q.view(m, k), (amax / torch.full_like(amax, 127.0)).view(m, -1)


def reference(x: torch.Tensor, bq: BlockQuant, colf: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in float64 from the BlockQuant: x [M, K] -> [M, N], x quantised by the kernel's rule
    times the weight (weight_of)."""
    q, step = quantise_activations(x.bfloat16(), bq.block)
    xq = (q.double().view(q.shape[0], -1, bq.block) * step.double().unsqueeze(-1)).view_as(q)
    y = xq @ weight_of(bq, colf).double().t()
    return y if bias is None else y + bias.double()


def linear(x: torch.Tensor, w: QWeightI8, bias: torch.Tensor | None = None, out: torch.dtype | None = None
           ) -> torch.Tensor:
    """x [..., K] (fp32 rows are rounded to bf16 first) -> [..., N] in `out` (default x's dtype)."""
    lead, dtype = x.shape[:-1], out or x.dtype
    rows = x.reshape(-1, w.in_features).to(torch.bfloat16).contiguous()
    if rows.shape[0] >= WIDE_ROWS:                     # a prefill's chunk: bf16 activations, one bf16 matmul
        y = rows @ w.dequantise_t()
        return (y if bias is None else y + bias.to(torch.bfloat16)).to(dtype).view(*lead, w.out_features)
    f32 = dtype != torch.bfloat16
    y = torch.empty(rows.shape[0], w.out_features, dtype=torch.float32 if f32 else torch.bfloat16)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    fn = _lib().upesi_qgemm_i8_f32 if f32 else _lib().upesi_qgemm_i8
    fn(rows.data_ptr(), rows.shape[0], rows.stride(0), w.in_features, w.desc.data_ptr(),
       None if b is None else b.data_ptr(), w.out_features, y.data_ptr(), y.stride(0), torch.get_num_threads())
    return y.to(dtype).view(*lead, w.out_features)
