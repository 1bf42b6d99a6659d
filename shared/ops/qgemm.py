"""Block-quantised weights kept packed, multiplied by a C kernel that reads the codes (qgemm.c).

A 4-bit model exists for speed: decode reads every weight once a step, so a step's time follows the bytes read.
The formats Upesi serves (NVFP4; GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) all reduce to one form, `BlockQuant`:
per block of 16 or 32 input features of an output column, w = value(code) * scale + min, value() exact in bf16
(a 16-entry table for 4-bit codes, the int8 code itself for 8-bit ones). `pack` lays that form out once at load
in the order the kernel streams; the kernel expands the codes in registers and multiplies them with vdpbf16ps,
scaling each block's sum in fp32 (qgemm.c has the layout and the arithmetic).

Exactness: with bf16 rows every product value * x is exact in fp32, so a row's result is the dequantised weight's
result up to the order of accumulation. fp32 rows are split into three bf16 parts (hi + mid + lo == x exactly),
run as three rows and added in fp32: the fp32 product up to accumulation order, at three rows' cost. The torch
reference is `BlockQuant.dequantise` (the weight the file describes) with F.linear (tests/unit/test_qgemm.py).

Built with shared.ops.c_build at first use; where it cannot run (no avx512_bf16, no compiler, UPESI_QGEMM=0, a
self-check that disagrees) `available()` is False and callers keep a dequantised copy instead.
Shapes: M = rows, K = in features, N = out features, B = K / block, U = units of 32 columns.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shared.ops import c_build
from shared.ops.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
AMX_SOURCE = SOURCE.with_name("qgemm_amx.c")
AMX_FLAGS = FLAGS + ["-mamx-tile", "-mamx-bf16"]
UNIT = 32                                             # output columns per unit (UNIT in the C source)
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


class QuantFormatError(ValueError):
    """A block-quantised weight this kernel cannot lay out (shape or block size)."""


@dataclass(slots=True)
class BlockQuant:
    """An [N, K] weight as codes and per-block scales: w[n, k] = value(codes[n, k]) * scales[n, k // block]
    (+ mins[n, k // block]).

    bits 4: codes uint8 in 0..15, value = lut[code] (16 fp32 values, each exact in bf16);
    bits 8: codes int8, value = the code.
    scale_f16: every scale and min is exactly an fp16 value (GGUF's Q4_0 / Q4_1 / Q8_0), so they pack in 2 bytes.
    """
    codes: torch.Tensor                  # [N, K] uint8 (4-bit) or int8 (8-bit)
    scales: torch.Tensor                 # [N, B] fp32
    mins: torch.Tensor | None            # [N, B] fp32
    block: int                           # 16 or 32 input features
    bits: int
    lut: torch.Tensor | None = None      # [16] fp32 (4-bit)
    scale_f16: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def values(self) -> torch.Tensor:
        """[N, K] fp32: value(code)."""
        return self.lut[self.codes.long()] if self.bits == 4 else self.codes.float()

    def dequantise(self) -> torch.Tensor:
        """[N, K] fp32, rounded as GGUF's and NVFP4's own dequantisation round: value * scale, then + min."""
        n, k = self.shape
        w = self.values().view(n, -1, self.block) * self.scales.unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.view(n, k)

    def rows(self, lo: int, hi: int) -> BlockQuant:
        """Output rows [lo, hi) (a slice of gate / up), copied."""
        cut = (lambda t: None if t is None else t[lo:hi].clone())
        return BlockQuant(cut(self.codes), cut(self.scales), cut(self.mins), self.block, self.bits, self.lut,
                          self.scale_f16)

    def columns(self, lo: int, hi: int) -> BlockQuant:
        """Input features [lo, hi) (a slice of down), copied; lo and hi must fall on blocks."""
        if lo % self.block or hi % self.block:
            raise QuantFormatError(f"a weight in blocks of {self.block} can only be split on blocks, not [{lo}, "
                                   f"{hi}); use a shard count that divides the FFN width in multiples of it")
        cut = (lambda t: None if t is None else t[:, lo // self.block:hi // self.block].clone())
        return BlockQuant(self.codes[:, lo:hi].clone(), cut(self.scales), cut(self.mins), self.block, self.bits,
                          self.lut, self.scale_f16)

    def with_block(self, block: int) -> BlockQuant:
        """The same weight with blocks of `block` (a divisor of this one's): scales repeated."""
        if block == self.block:
            return self
        r = self.block // block
        rep = (lambda t: None if t is None else t.repeat_interleave(r, dim=1))
        return BlockQuant(self.codes, rep(self.scales), rep(self.mins), block, self.bits, self.lut, self.scale_f16)

    def as_8bit(self) -> BlockQuant:
        """4-bit codes as int8 values (exact where the table holds integers or halves: halves double, scales halve)."""
        if self.bits == 8:
            return self
        lut = self.lut
        f = 1.0 if torch.equal(lut, lut.round()) else 2.0
        if not torch.equal(lut * f, (lut * f).round()) or (lut * f).abs().max() > 127:
            raise QuantFormatError("a 4-bit table that is not integers or halves cannot widen to 8 bits")
        codes = (lut * f)[self.codes.long()].to(torch.int8)
        # halving an fp32 scale is exact, so value * scale is unchanged
        return BlockQuant(codes, self.scales / f, self.mins, self.block, 8, None, self.scale_f16 and f == 1.0)

    @staticmethod
    def cat(parts: list[BlockQuant]) -> BlockQuant:
        """Row-wise concatenation (q/k/v of a fused layer), widened to the finest block, 8 bits where the parts'
        tables differ, fp32 scales and mins where any part needs them."""
        if len(parts) == 1:
            return parts[0]
        block = min(p.block for p in parts)
        parts = [p.with_block(block) for p in parts]
        same4 = all(p.bits == 4 for p in parts) and all(torch.equal(p.lut, parts[0].lut) for p in parts)
        if not same4:
            parts = [p.as_8bit() for p in parts]
        has_min = any(p.mins is not None for p in parts)
        mins = (torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
                if has_min else None)
        return BlockQuant(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins, block,
                          parts[0].bits, parts[0].lut, all(p.scale_f16 for p in parts))


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if "avx512_bf16" not in cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_QGEMM", "quantised rows kernel")
    if lib is None:
        return None
    for fn in (lib.upesi_qgemm, lib.upesi_qgemm_f32):
        fn.argtypes, fn.restype = _ARGS, None
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
        fn.argtypes, fn.restype = _ARGS, None
    lib.upesi_qgemm_amx_setup.restype = ctypes.c_int
    if lib.upesi_qgemm_amx_setup() != 0:
        log.warning("the kernel refused this process AMX's tile state; quantised layers use AVX512-BF16")
        return None
    return lib


@dataclass(slots=True)
class _Kernel:
    """A BlockQuant in the kernel's terms (qgemm.c): codes expand to e = value * f + shift, a bf16 number built
    from the code's bits; scales = scale / f (exact: f is 1 or 2), mins unchanged."""
    kind: int                            # 5: affine nibbles, 4: nibbles through `table`, 7: bytes, 8: int8 values
    codes: torch.Tensor                  # [N, K] uint8: 4-bit codes (5, 4), low bytes (7); int8 values (8)
    table: torch.Tensor | None           # [128] uint8: the values' bf16 low bytes, then high bytes, 4 times each (4)
    high: int                            # the high byte every e shares (7)
    shift: float
    scales: torch.Tensor                 # [N, B] fp32
    mins: torch.Tensor | None            # [N, B] fp32


def _shifted(t: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """Integers t (0 <= t < 128) -> (the low bytes of bf16(base + t), their shared high byte, base): base is the
    power of two above every t, so base + t is exact in bf16 and only its low byte depends on t."""
    base = 1.0
    while base <= t.max().item():
        base *= 2
    e = base + t.float()
    bits = e.bfloat16().view(torch.int16).int() & 0xFFFF
    if not torch.equal(e.bfloat16().float(), e) or (bits >> 8).unique().numel() != 1:
        raise QuantFormatError("codes do not fit a bf16 mantissa")
    return (bits & 0xFF).to(torch.uint8), int(bits.flatten()[0].item()) >> 8, base


def _kernel_form(bq: BlockQuant) -> _Kernel:
    if bq.bits == 4:
        lut = bq.lut.float()
        f = 1.0 if torch.equal(lut, lut.round()) else 2.0
        tv = lut * f
        if torch.equal(tv, tv.round()) and torch.equal(tv - tv.min(), torch.arange(16.0)):     # e = 16 + code
            return _Kernel(5, bq.codes, None, 0, 16.0 - tv.min().item(), bq.scales / f, bq.mins)
        if torch.equal(lut.bfloat16().float(), lut):                                          # e = lut[code]
            bits = lut.bfloat16().view(torch.int16).int() & 0xFFFF
            table = torch.cat(((bits & 0xFF).repeat(4), (bits >> 8).repeat(4))).to(torch.uint8)
            return _Kernel(4, bq.codes, table, 0, 0.0, bq.scales, bq.mins)
        bq = bq.as_8bit()
    lo, hi = int(bq.codes.min()), int(bq.codes.max())
    if hi - lo < 128:
        table, high, base = _shifted(torch.arange(hi - lo + 1))
        return _Kernel(7, table[bq.codes.long() - lo], None, high, base - lo, bq.scales, bq.mins)
    return _Kernel(8, bq.codes.view(torch.uint8), None, 0, 0.0, bq.scales, bq.mins)


def _fits_f16(t: torch.Tensor | None) -> bool:
    return t is not None and torch.equal(t.half().float(), t)


class QWeight:
    """A BlockQuant laid out for qgemm.c: `data` [U, B, record] uint8 and the kernel's descriptor `desc`. Not a
    tensor subclass, so `.to()` and state_dict never see it."""

    def __init__(self, bq: BlockQuant) -> None:
        n, k = bq.shape
        if bq.block not in (16, 32) or k % bq.block or bq.bits not in (4, 8):
            raise QuantFormatError(f"cannot pack a [{n}, {k}] weight of {bq.bits}-bit codes in blocks of {bq.block}")
        self.out_features, self.in_features, self.block = n, k, bq.block
        kf = _kernel_form(bq)
        self.kind, sf16, mf16 = kf.kind, _fits_f16(kf.scales), _fits_f16(kf.mins)
        self.data = pack(kf, bq.block, sf16, mf16)
        self.table = (kf.table if kf.table is not None else torch.zeros(128, dtype=torch.uint8)).contiguous()
        self._meta = (sf16, mf16, kf.mins is not None, self.table, kf.high, kf.shift)
        shift_bits = int(torch.tensor([kf.shift], dtype=torch.float32).view(torch.int32).item())
        self.desc = torch.tensor([self.data.data_ptr(), self.table.data_ptr(), kf.high, kf.kind, bq.block // 2,
                                  int(sf16), int(mf16), int(kf.mins is not None), k // bq.block,
                                  self.data.shape[-1], shift_bits], dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantise(self) -> torch.Tensor:
        """[N, K] fp32 from the packed form: the weight the kernel multiplies by (the file's, exactly)."""
        return unpack(self.data, self.out_features, self.in_features, self.kind, self.block, *self._meta)


def _code_order(kind: int, units: int, nb: int, bkk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """How codes [U * 32, K] map to the kernel's bytes: the view of the codes and the permutation to apply."""
    if kind == 5:   # chunk of 2 pairs: byte 2 w + pair parity, nibble = panel; w = 2 col + feat
        return (units, 2, 16, nb, bkk // 2, 2, 2), (0, 3, 4, 2, 6, 5, 1)
    if kind == 4:   # chunk of 2 pairs: byte 16 (w // 8) + 8 panel + w % 8, nibble = pair parity; w = 2 col + feat
        return (units, 2, 4, 4, nb, bkk // 2, 2, 2), (0, 4, 5, 2, 1, 3, 7, 6)
    if kind == 7:   # a pair: byte 16 (w // 8) + 8 panel + w % 8
        return (units, 2, 4, 4, nb, bkk, 2), (0, 4, 5, 2, 1, 3, 6)
    return (units, 2, 16, nb, bkk, 2), (0, 3, 4, 1, 2, 5)


def pack(kf: _Kernel, block: int, sf16: bool, mf16: bool) -> torch.Tensor:
    """The kernel form [N, K] -> [U, B, record] uint8: per unit of 32 columns and block, the codes (qgemm.c's
    order), then the 32 scales and the 32 mins (fp16 or fp32). Columns past N have zero codes, scales and mins."""
    n, k = kf.codes.shape
    nb, bkk, units = k // block, block // 2, -(-n // UNIT)
    pad = units * UNIT - n
    codes = F.pad(kf.codes.view(torch.uint8), (0, 0, 0, pad))                        # [N', K]
    if kf.kind == 5:
        parts = [_pack_affine_nibbles(codes, units, nb, bkk)]
    else:
        view, perm = _code_order(kf.kind, units, nb, bkk)
        c = codes.view(*view).permute(*perm).contiguous()
        if kf.kind == 4:
            c = c[..., 0] | (c[..., 1] << 4)
        parts = [c.reshape(units, nb, -1)]
    for s, f16 in ((kf.scales, sf16), (kf.mins, mf16)):
        if s is None:
            continue
        s = F.pad(s, (0, 0, 0, pad)).to(torch.float16 if f16 else torch.float32)     # [N', B]
        parts.append(s.view(units, UNIT, nb).transpose(1, 2).contiguous().view(torch.uint8).view(units, nb, -1))
    return torch.cat(parts, dim=-1).contiguous()


def _pack_affine_nibbles(codes: torch.Tensor, units: int, nb: int, bkk: int) -> torch.Tensor:
    """Kind 5's bytes (_code_order's) by whole-word moves: a byte joins the two panels' codes of one column and
    feature (nibbles), each column's 2 x 2 (pair parity, feature) bytes are reordered inside their 32-bit word,
    and the words of 16 columns are transposed into place."""
    c = codes.view(units, 2, 16, -1)
    both = (c[:, 0] | (c[:, 1] << 4)).numpy()                                       # [U, 16, K] panel nibbles
    words = both.view(np.uint32)                                    # [U, 16, K / 4]: (k0f0 k0f1 k1f0 k1f1)
    words = (words & 0xFF0000FF) | ((words >> 8) & 0x0000FF00) | ((words << 8) & 0x00FF0000)   # (k0f0 k1f0 k0f1 k1f1)
    out = torch.from_numpy(words.view(np.int32)).view(units, 16, nb, bkk // 2).permute(0, 2, 3, 1).contiguous()
    return out.view(torch.uint8).view(units, nb, -1)


def unpack(data: torch.Tensor, n: int, k: int, kind: int, block: int, sf16: bool, mf16: bool, has_min: bool,
           table: torch.Tensor, high: int, shift: float) -> torch.Tensor:
    """[U, B, record] -> the dense [N, K] fp32 weight the kernel multiplies by."""
    units, nb, _ = data.shape
    bkk = block // 2
    code_bytes = 2 * bkk * (16 if kind in (4, 5) else 32)
    c = data[..., :code_bytes]
    view, perm = _code_order(kind, units, nb, bkk)
    if kind in (4, 5):
        c = torch.stack((c & 0xF, c >> 4), dim=-1)
    inv = [perm.index(i) for i in range(len(perm))]
    c = c.reshape(*(view[i] for i in perm)).permute(*inv).reshape(units * UNIT, k)[:n]
    if kind == 5:
        values = 16.0 + c.float()
    elif kind == 4:
        bits = table[:16].int() | (table[64:80].int() << 8)                          # the 16 values' bf16 bits
        values = bits.to(torch.int16).view(torch.bfloat16).float()[c.long()]
    elif kind == 7:
        values = ((high << 8) | c.int()).to(torch.int16).view(torch.bfloat16).float()
    else:
        values = c.contiguous().view(torch.int8).float()
    values = values - shift
    sides, at = [], code_bytes
    for f16 in (sf16, mf16)[:1 + has_min]:
        size = UNIT * (2 if f16 else 4)
        s = data[..., at:at + size].contiguous().view(torch.float16 if f16 else torch.float32)
        sides.append(s.view(units, nb, UNIT).transpose(1, 2).reshape(units * UNIT, nb)[:n].float())
        at += size
    w = values.view(n, nb, block) * sides[0].unsqueeze(-1)
    if has_min:
        w = w + sides[1].unsqueeze(-1)
    return w.view(n, k)


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


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [3, M, K] bf16 whose sum is x exactly (hi, mid, lo; each the rounded remainder)."""
    hi = x.bfloat16()
    r = x - hi.float()
    mid = r.bfloat16()
    lo = (r - mid.float()).bfloat16()
    return torch.stack((hi, mid, lo))


def run(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 or fp32 on CPU -> x @ W^T (+ bias) [M, N] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
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
    if (x.device.type != "cpu" or not x.dtype.is_floating_point or not available()
            or (torch.is_grad_enabled() and x.requires_grad)):
        return F.linear(x, w.dequantise().to(device=x.device, dtype=x.dtype), bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, w.in_features)
    if x.dtype not in (torch.bfloat16, torch.float32):
        return run(rows.float(), w, None if bias is None else bias.float()).to(x.dtype).view(*lead, w.out_features)
    return run(rows, w, bias).view(*lead, w.out_features)


def example(kind: str, n: int, k: int, block: int, g: torch.Generator, has_min: bool = True) -> BlockQuant:
    """A random BlockQuant of one of the kernel's paths: "u4" (integer table), "e2m1" (NVFP4's table of halves),
    "u6" (8-bit codes of a small range: GGUF's 5- and 6-bit types), "i8" (int8 codes); fp16-exact scales for "u4"."""
    if kind in ("u4", "e2m1"):
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        lut = (torch.arange(16.0) if kind == "u4" else
               torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]))
    else:
        lo, hi = (-32, 32) if kind == "u6" else (-128, 128)
        codes, lut = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8), None
    scales = torch.rand(n, k // block, generator=g) + 0.01
    mins = torch.randn(n, k // block, generator=g) if has_min else None
    f16 = kind == "u4"
    if f16:
        scales, mins = scales.half().float(), None if mins is None else mins.half().float()
    return BlockQuant(codes, scales, mins, block, 4 if lut is not None else 8, lut, f16)


def _agrees(fns: tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]) -> bool:
    """Whether the kernels `fns` (bf16 and fp32 output) agree with the reference on every path, with and without
    mins, a partial unit of columns, a partial group of rows, and give a row alone the bits it has among others."""
    g = torch.Generator().manual_seed(0)
    for kind, block, has_min in (("u4", 32, True), ("e2m1", 16, False), ("u6", 16, True), ("i8", 32, False)):
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


def available() -> bool:
    """True where a quantised kernel builds, loads and agrees with the reference on this machine."""
    return _kernels() is not None


def uses_amx() -> bool:
    return available() and _amx_lib() is not None and _kernels()[0] is _amx_lib().upesi_qgemm_amx


def kernel_address() -> int:
    """The address of this machine's bf16 quantised GEMM, for C callers (decoder_bf16.c); requires available()."""
    return ctypes.cast(_kernels()[0], ctypes.c_void_p).value
