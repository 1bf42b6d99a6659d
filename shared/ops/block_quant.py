"""Block-quantised weights in one form, whatever their format (NVFP4; GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K):
per block of 16 or 32 input features of an output column, w = value(code) * scale + min, value() exact in bf16 (a
16-entry table for 4-bit codes, the int8 code itself for 8-bit ones), times a per-column factor where the format
has one (NVFP4's 1 / global scale: its fp8 block scales then stay exact). `dequantise` is the torch reference the
kernels of shared.ops.qgemm are tested against. Shapes: N = out features, K = in features, B = K / block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class QuantFormatError(ValueError):
    """A block-quantised weight this kernel cannot lay out (shape or block size)."""


@dataclass(slots=True)
class BlockQuant:
    """An [N, K] weight as codes and per-block scales: w[n, k] = (value(codes[n, k]) * scales[n, k // block]
    (+ mins[n, k // block])) * col_scale[n].

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
    col_scale: torch.Tensor | None = None   # [N] fp32, applied to each output column's sum (None: 1)

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
        if self.col_scale is not None:
            w = w * self.col_scale.view(n, 1, 1)
        return w.view(n, k)

    def rows(self, lo: int, hi: int) -> BlockQuant:
        """Output rows [lo, hi) (a slice of gate / up), copied."""
        cut = (lambda t: None if t is None else t[lo:hi].clone())
        return BlockQuant(cut(self.codes), cut(self.scales), cut(self.mins), self.block, self.bits, self.lut,
                          self.scale_f16, cut(self.col_scale))

    def columns(self, lo: int, hi: int) -> BlockQuant:
        """Input features [lo, hi) (a slice of down), copied; lo and hi must fall on blocks."""
        if lo % self.block or hi % self.block:
            raise QuantFormatError(f"a weight in blocks of {self.block} can only be split on blocks, not [{lo}, "
                                   f"{hi}); use a shard count that divides the FFN width in multiples of it")
        cut = (lambda t: None if t is None else t[:, lo // self.block:hi // self.block].clone())
        return BlockQuant(self.codes[:, lo:hi].clone(), cut(self.scales), cut(self.mins), self.block, self.bits,
                          self.lut, self.scale_f16, self.col_scale)

    def with_block(self, block: int) -> BlockQuant:
        """The same weight with blocks of `block` (a divisor of this one's): scales repeated."""
        if block == self.block:
            return self
        r = self.block // block
        rep = (lambda t: None if t is None else t.repeat_interleave(r, dim=1))
        return BlockQuant(self.codes, rep(self.scales), rep(self.mins), block, self.bits, self.lut, self.scale_f16,
                          self.col_scale)

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
        return BlockQuant(codes, self.scales / f, self.mins, self.block, 8, None, self.scale_f16 and f == 1.0,
                          self.col_scale)

    @staticmethod
    def int8(w: torch.Tensor, block: int = 32) -> BlockQuant:
        """w [N, K] (K a multiple of block) as int8 codes with one fp32 scale per block: amax / 127, as GGUF's Q8_0
        (round to nearest; a block of zeros gets scale 0). Lossy: for weights whose products need not be exact."""
        n, k = w.shape
        if k % block:
            raise QuantFormatError(f"cannot quantise [{n}, {k}] in blocks of {block}")
        blocks = w.float().reshape(n, k // block, block)
        scales = blocks.abs().amax(-1) / 127                                            # [N, B]
        codes = (blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round().clamp(-127, 127)
        return BlockQuant(codes.reshape(n, k).to(torch.int8), scales, None, block, 8)

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
        col = (torch.cat([p.col_scale if p.col_scale is not None else torch.ones(p.shape[0]) for p in parts])
               if any(p.col_scale is not None for p in parts) else None)
        return BlockQuant(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins, block,
                          parts[0].bits, parts[0].lut, all(p.scale_f16 for p in parts), col)


def example(kind: str, n: int, k: int, block: int, g: torch.Generator, has_min: bool = True) -> BlockQuant:
    """A random BlockQuant of one of the kernel's paths: "u4" (integer table), "e2m1" (NVFP4's table of halves),
    "nvfp4" (that table with fp8 E4M3 block scales and a factor per column, as NVFP4 checkpoints load), "u6" (8-bit
    codes of a small range: GGUF's 5- and 6-bit types), "i8" (int8 codes); fp16-exact scales for "u4"."""
    if kind == "nvfp4":
        bq = example("e2m1", n, k, block, g, False)
        bq.scales = (torch.rand(n, k // block, generator=g) * 448).to(torch.float8_e4m3fn).float()
        bq.col_scale = torch.rand(n, generator=g) / 448 + 1e-4
        return bq
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
