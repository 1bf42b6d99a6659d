"""The packed layout of shared.ops.qgemm's kernels (qgemm.h describes it from the C side): a BlockQuant in the
kernel's terms (`kernel_form`), laid out once at load in units of 32 output columns (`pack`), and back (`unpack`).
Shapes: N = out features, K = in features, B = K / block, U = units of 32 columns, BKK = feature pairs a block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shared.ops.block_quant import BlockQuant, QuantFormatError

UNIT = 32                                             # output columns per unit (UNIT in qgemm.h)


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


def kernel_form(bq: BlockQuant) -> _Kernel:
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


def fits_f16(t: torch.Tensor | None) -> bool:
    return t is not None and torch.equal(t.half().float(), t)


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
           table: torch.Tensor, high: int, shift: float, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[U, B, record] (and the columns' factors [U * 32]) -> the dense [N, K] fp32 weight the kernel multiplies
    by, rounded as BlockQuant.dequantise."""
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
    if col_scale is not None:
        w = w * col_scale[:n].view(n, 1, 1)
    return w.view(n, k)
