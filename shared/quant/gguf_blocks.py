"""GGUF's block-quantised tensors read as codes and scales (shared.ops.qgemm.BlockQuant), so they stay 4- or 8-bit.

llama.cpp's types, each a row of blocks along the input features (ggml-common.h; gguf.quants dequantises them the
same way, and the tests compare every type against it bit for bit):

    Q4_0  32 weights: fp16 d, 16 bytes of nibbles              w = d * (q - 8)
    Q4_1  32 weights: fp16 d, fp16 m, 16 bytes of nibbles      w = d * q + m
    Q8_0  32 weights: fp16 d, 32 int8                          w = d * q
    Q4_K  256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
          nibbles                                              w = (d * sc) * q - dmin * m
    Q5_K  as Q4_K, plus 32 bytes of fifth bits                 w = (d * sc) * q - dmin * m,  q in 0..31
    Q6_K  256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (sub-blocks of 16), fp16 d
                                                               w = (d * sc) * (q - 32)

A nibble byte holds element j (low) and j + 16 (high) of a 32-weight block (Q4_0 / Q4_1), or, in the K-quants,
elements j and j + 32 of a 64-weight pair of sub-blocks. Every scale and min is a product of an fp16 and a small
integer, exact in fp32. Shapes: N = rows (out features), K = in features, S = sub-blocks per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from shared.ops.block_quant import BlockQuant

PACKED_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
_BLOCK_BYTES = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q5_K: (256, 176),
                T.Q6_K: (256, 210)}
_IDENTITY = torch.arange(16.0)


@dataclass(frozen=True, slots=True)
class GGUFRaw:
    """A GGUF tensor as the file stores it: its bytes [N, K / block * bytes] (rows already in Hugging Face's
    order), its type and its [N, K] shape. The weight stream yields these for the layers kept packed."""
    data: np.ndarray
    kind: T
    shape: tuple[int, int]

    def block_quant(self) -> BlockQuant:
        return gguf_block_quant(self.data, self.kind, self.shape)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[..., G / 2 * n] bytes -> [..., G * n] codes: in each group of G / 2 bytes, low nibbles are the group's
    first G / 2 elements and high nibbles the next."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, group // 2)
    return torch.cat((q & 0xF, q >> 4), dim=-2).reshape(*qs.shape[:-1], -1)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> (scales, mins) [..., 8] as integers 0..63."""
    d, m, md = sc[..., 0:4].int(), sc[..., 4:8].int(), sc[..., 8:12].int()
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales, mins


def gguf_block_quant(data: np.ndarray, kind: T, shape: tuple[int, int]) -> BlockQuant:
    """A GGUF tensor's bytes [N, K / block * bytes] (gguf_index's view) of `kind` -> its BlockQuant [N, K]."""
    if kind not in PACKED_TYPES:
        raise ValueError(f"GGUF type {kind.name} is not kept packed (types that are: "
                         f"{', '.join(t.name for t in sorted(PACKED_TYPES))})")
    n, k = shape
    block, size = _BLOCK_BYTES[kind]
    b = torch.from_numpy(np.array(data)).view(n, k // block, size)                       # [N, K / block, bytes]
    if kind in (T.Q4_0, T.Q4_1):
        at = 2 if kind == T.Q4_0 else 4
        codes = _nibbles(b[..., at:], 32).reshape(n, k).to(torch.uint8)
        d = _f16(b[..., 0:2])
        if kind == T.Q4_0:
            return BlockQuant(codes, d, None, 32, 4, _IDENTITY - 8, scale_f16=True)
        return BlockQuant(codes, d, _f16(b[..., 2:4]), 32, 4, _IDENTITY, scale_f16=True)
    if kind == T.Q8_0:
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return BlockQuant(codes, _f16(b[..., 0:2]), None, 32, 8, scale_f16=True)
    if kind in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)         # [N, K / 256, 1]
        sc, mn = _k_scales(b[..., 4:16])
        scales = (d * sc.float()).reshape(n, -1)                                            # [N, S]
        mins = -(dmin * mn.float()).reshape(n, -1)
        if kind == T.Q4_K:
            codes = _nibbles(b[..., 16:], 64).reshape(n, k).to(torch.uint8)
            return BlockQuant(codes, scales, mins, 32, 4, _IDENTITY)
        low = _nibbles(b[..., 48:], 64)                                                     # [N, K / 256, 256]
        qh = b[..., 16:48].int()                                    # bit s of byte j: element 32 s + j
        high = torch.stack([(qh >> s) & 1 for s in range(8)], dim=-2).reshape(n, -1, 256)
        codes = (low.int() | (high << 4)).to(torch.int8).reshape(n, k)
        return BlockQuant(codes, scales, mins, 32, 8)
    # Q6_K: within each half of 128: ql bytes 0-31 low nibbles -> elements 0-31, bytes 32-63 -> 32-63, their high
    # nibbles -> 64-95 and 96-127; qh byte j holds 2 bits for elements j, j + 32, j + 64, j + 96
    ql, qh = b[..., 0:128].int().view(n, -1, 2, 64), b[..., 128:192].int().view(n, -1, 2, 32)
    low = torch.cat((ql & 0xF, ql >> 4), dim=-1)                                            # [N, K/256, 2, 128]
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
    codes = ((low | (high << 4)) - 32).to(torch.int8).reshape(n, k)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()                             # [N, K / 256, 16]
    scales = (_f16(b[..., 208:210]).unsqueeze(-1) * sc).reshape(n, -1)
    return BlockQuant(codes, scales, None, 16, 8)
