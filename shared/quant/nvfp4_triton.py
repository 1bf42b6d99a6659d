"""Triton W4A16 GEMM on NVFP4 weights: y = x @ dequant(W)^T, reading packed E2M1 codes and fp8 block scales.

Shapes: M = rows of x, K = in features (a multiple of 16), N = out features, B = K // 16.
Reference: shared.quant.nvfp4_linear.nvfp4_linear(x, w) (act_quant=False); tests/unit/test_nvfp4_triton.py
compares the two under TRITON_INTERPRET=1.

Numerics: code * fp8 scale is exact in bf16 / fp16 (at most 6 significant bits, magnitudes 2^-10 .. 2688), so
the tile fed to tl.dot is the exact weight up to the per-tensor global scale, which is divided out of the fp32
accumulator at the end. The only roundings are the dot's fp32 accumulation and that final division.

Napkin math (decode, M small): per weight element 0.5 B of codes + 1/16 B of scale = 0.5625 B, against 2 B for
a bf16 weight: a [N, K] = [8192, 8192] GEMV moves ~38 MB, ~8 us at an H200's ~4.8 TB/s of HBM bandwidth.

The fp8 scales are decoded from their bits (uint8 view) so the kernel also runs on GPUs without native fp8
conversions and in the interpreter. The interpreter cannot tl.dot bf16 operands (it multiplies their bit patterns,
triton-lang/triton#11584), so under TRITON_INTERPRET=1 both tiles are upcast to fp32 first; that upcast is exact,
so the result only differs from the GPU's bf16 dot in the order of accumulation. The interpreter also truncates
fp32 -> bf16 casts, so there the kernel stores fp32 and torch rounds the output.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shared.quant.nvfp4 import NVFP4Error, NVFP4ShapeError, NVFP4Weight


class NVFP4DeviceError(NVFP4Error):
    """The Triton kernel was asked to run where it cannot (CPU tensors without TRITON_INTERPRET=1)."""


@triton.jit
def _e4m3_to_f32(b):
    """uint8 bits of a non-negative float8_e4m3fn -> float32 (normals and subnormals; NaN never stored)."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) * (1 + m/8)
    subnormal = m.to(tl.float32) * 0.001953125                             # m * 2^-9
    return tl.where(e == 0, subnormal, normal)


@triton.jit
def _e2m1_to_f32(c):
    """A 4-bit E2M1 code (int32) -> float32: 2x the magnitude is 0,1,2,3,4,6,8,12."""
    e = (c >> 1) & 0x3
    m = c & 0x1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    mag = twice.to(tl.float32) * 0.5
    return tl.where((c & 0x8) != 0, -mag, mag)


@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr, packed_ptr, scale_ptr, gs_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sb, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    offs_k = tl.arange(0, BLOCK_K)                                         # [BK]
    offs_p = tl.arange(0, BLOCK_K // 2)                                    # [BK/2] bytes of a K tile
    offs_b = tl.arange(0, BLOCK_K // 16)                                   # [BK/16] scales of a K tile
    mask_m = offs_m < M
    mask_n = offs_n < N

    # tl.full, not tl.zeros: tl.zeros is a @jit helper that breaks the interpreter when triton was imported first
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)                    # [BM, BN]
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K                                         # K % 16 == 0, so whole blocks
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                    mask=mask_m[:, None] & k_mask[None, :], other=0.0)     # [BM, BK]
        p_mask = mask_n[:, None] & ((k0 // 2 + offs_p) < K // 2)[None, :]
        p = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (k0 // 2 + offs_p)[None, :] * stride_pk,
                    mask=p_mask, other=0).to(tl.int32)                     # [BN, BK/2]
        codes = tl.join(_e2m1_to_f32(p & 0xF), _e2m1_to_f32(p >> 4))       # [BN, BK/2, 2]: even k in the low nibble
        s_mask = mask_n[:, None] & ((k0 // 16 + offs_b) < K // 16)[None, :]
        s = _e4m3_to_f32(tl.load(scale_ptr + offs_n[:, None] * stride_sn + (k0 // 16 + offs_b)[None, :] * stride_sb,
                                 mask=s_mask, other=0))                    # [BN, BK/16]
        w = tl.reshape(codes, (BLOCK_N, BLOCK_K // 16, 16)) * s[:, :, None]  # [BN, BK/16, 16], exact
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)                  # [BN, BK]
        if DOT_F32:  # exact upcast: products of bf16/fp16 values are exact in fp32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")  # [BM, BN]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    acc = acc / tl.load(gs_ptr)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)): from 17 rows on the fastest of a sweep on an H200 for
# 8192 x 8192 weights (bench/sweep_nvfp4_tiles.py; docs/gpu-kernels.md); up to 16 rows the launch dominates and
# no tile measured reliably faster than 32 x 64 x 64
TILES = [(16, (32, 64, 64, 4, 3)), (128, (128, 64, 128, 8, 4))]
LARGE_M_TILE = (128, 64, 64, 8, 3)


def tiles_for(m: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """The default (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for a product over m rows of x. The swept tiles are
    for 16-bit x; fp32 tiles take twice the shared memory (the 128-row ones do not fit), so fp32 keeps 32 x 64 x 64."""
    if dtype == torch.float32:
        return TILES[0][1]
    return next((t for most, t in TILES if m <= most), LARGE_M_TILE)


def nvfp4_matmul(x: torch.Tensor, w: NVFP4Weight, block_m: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None
                 ) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32) -> [..., N] in x's dtype: the W4A16 product on CUDA (or the interpreter).

    Raises NVFP4ShapeError on a K mismatch or a bad tile size and NVFP4DeviceError for CPU tensors outside
    TRITON_INTERPRET=1.
    """
    if x.shape[-1] != w.in_features:
        raise NVFP4ShapeError(f"x has {x.shape[-1]} features, the weight expects {w.in_features}")
    rows = x.numel() // max(1, x.shape[-1])
    dm, dn, dk, dw, ds = tiles_for(rows, x.dtype)
    if block_m is None and block_n is None and block_k is None:     # a tile given in part keeps the others' old
        num_warps = dw if num_warps is None else num_warps          # defaults, so explicit tiles mean the same
        num_stages = ds if num_stages is None else num_stages
        block_m, block_n, block_k = dm, dn, dk
    block_m, block_n, block_k = block_m or 32, block_n or 64, block_k or 64
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NVFP4ShapeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if any(b & (b - 1) for b in (block_m, block_n, block_k)) or min(block_m, block_n) < 16 or block_k < 32:
        raise NVFP4ShapeError(f"tile sizes must be powers of two, block_m and block_n >= 16, block_k >= 32; got "
                              f"{block_m}x{block_n}x{block_k}")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if x.device.type != "cuda" and not interpreting:
        raise NVFP4DeviceError("nvfp4_matmul needs CUDA tensors (or TRITON_INTERPRET=1); use "
                               "shared.quant.nvfp4_linear.nvfp4_linear on CPU")
    if w.packed.device != x.device or w.scale.device != x.device:
        raise NVFP4DeviceError(f"x is on {x.device} but the weight is on {w.packed.device}")
    x2 = x.reshape(-1, x.shape[-1])                                        # [M, K]
    m, k, n = x2.shape[0], w.in_features, w.out_features
    # the interpreter truncates fp32 -> bf16 instead of rounding to nearest even: let torch do that cast there
    out = torch.empty((m, n), dtype=torch.float32 if interpreting else x.dtype, device=x.device)  # [M, N]
    scale = w.scale.view(torch.uint8)                                      # [N, B] fp8 bits
    gs = w.global_scale.to(device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _nvfp4_gemm_kernel[grid](
        x2, w.packed, scale, gs, out, m, n, k,
        x2.stride(0), x2.stride(1), w.packed.stride(0), w.packed.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=x.dtype == torch.float32 or interpreting,
        **({} if num_warps is None else {"num_warps": num_warps}),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
