"""Triton W4A16 GEMM on NVFP4 weights: y = x @ dequant(W)^T, reading packed E2M1 codes and fp8 block scales.

Shapes: M = rows of x, K = in features (a multiple of 16), N = out features, B = K // 16.
Reference: shared.quant.nvfp4_linear.nvfp4_linear(x, w) (act_quant=False); tests/unit/test_nvfp4_triton.py
compares the two under TRITON_INTERPRET=1.

Numerics: code * fp8 scale is exact in bf16 / fp16 (at most 6 significant bits, magnitudes 2^-10 .. 2688), so
the tile fed to tl.dot is the exact weight up to the per-tensor global scale, which is divided out of the fp32
accumulator at the end. The only roundings are the dot's fp32 accumulation and that final division.

Two kernels: a tiled one (tl.dot on tensor cores) and, for up to GEMV_ROWS rows, a GEMV-like one without
tensor cores that splits K over programs when N alone gives too few (fp32 partial sums reduced by a
second launch, in split order, so the result does not depend on scheduling).

Napkin math (decode, M small): per weight element 0.5 B of codes + 1/16 B of scale = 0.5625 B, against 2 B for
a bf16 weight: a [N, K] = [8192, 8192] GEMV moves ~38 MB, ~8 us at an H200's ~4.8 TB/s of HBM bandwidth.

The fp8 scales are decoded from their bits (uint8 view) so the kernel also runs on GPUs without native fp8
conversions and in the interpreter. The interpreter cannot tl.dot bf16 operands (it multiplies their bit patterns,
triton-lang/triton#11584), so under TRITON_INTERPRET=1 both tiles are upcast to fp32 first; that upcast is exact,
so the result only differs from the GPU's bf16 dot in the order of accumulation. The interpreter also truncates
fp32 -> bf16 casts, so there the kernel stores fp32 and torch rounds the output.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from shared.quant.nvfp4 import NVFP4Error, NVFP4ShapeError, NVFP4Weight


# tl.sum is a @jit wrapper around this combine function, which breaks the interpreter when triton was imported
# before TRITON_INTERPRET was set; tl.reduce is a builtin the interpreter maps to numpy
_SUM = tl.standard._sum_combine


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
def _e2m1_scaled(c):
    """4-bit E2M1 codes (int32) -> float32 values times 2^-14, exactly: the sign and three magnitude bits become an
    fp16's sign, two low exponent bits and top mantissa bit (E2M1's subnormal 0.5 is fp16's subnormal 2^-15)."""
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


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
        codes = tl.join(_e2m1_scaled(p & 0xF), _e2m1_scaled(p >> 4))       # [BN, BK/2, 2]: even k in the low nibble
        s_mask = mask_n[:, None] & ((k0 // 16 + offs_b) < K // 16)[None, :]
        s = _e4m3_to_f32(tl.load(scale_ptr + offs_n[:, None] * stride_sn + (k0 // 16 + offs_b)[None, :] * stride_sb,
                                 mask=s_mask, other=0)) * 16384.0          # [BN, BK/16], times 2^14: exact
        w = tl.reshape(codes, (BLOCK_N, BLOCK_K // 16, 16)) * s[:, :, None]  # [BN, BK/16, 16], exact
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)                  # [BN, BK]
        if DOT_F32:  # exact upcast: products of bf16/fp16 values are exact in fp32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")  # [BM, BN]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    acc = acc / tl.load(gs_ptr)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, packed_ptr, scale_ptr, gs_ptr, out_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_xk, stride_pn, stride_sn, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):
    """Program (n, s): rows offs_n of W over K range [s * K_SPLIT, (s + 1) * K_SPLIT), every row of x (M <= BM).
    Byte j of a row holds elements 2j (low nibble) and 2j + 1, so x is read as its even and odd columns."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)                                         # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN]
    offs_p = tl.arange(0, BLOCK_K // 2)                                    # [BK/2]
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N, BLOCK_K // 2), 0.0, tl.float32)      # [BM, BN, BK/2], summed over K at the end
    k_lo = pid_s * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        j = k0 // 2 + offs_p                                               # [BK/2] byte columns
        wm = mask_n[:, None] & (j < K // 2)[None, :]
        p = tl.load(packed_ptr + offs_n[:, None] * stride_pn + j[None, :], mask=wm, other=0).to(tl.int32)
        s = tl.load(scale_ptr + offs_n[:, None] * stride_sn + (j // 8)[None, :], mask=wm, other=0)
        s = _e4m3_to_f32(s) * 16384.0                                      # [BN, BK/2]: each byte's block scale
        lo = _e2m1_scaled(p & 0xF) * s                                     # [BN, BK/2] exact weights, even k
        hi = _e2m1_scaled(p >> 4) * s                                      # odd k
        xm = mask_m[:, None] & (j < K // 2)[None, :]
        xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + (2 * j)[None, :] * stride_xk, mask=xm, other=0.0)
        xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + (2 * j + 1)[None, :] * stride_xk, mask=xm, other=0.0)
        acc += xe.to(tl.float32)[:, None, :] * lo[None, :, :] + xo.to(tl.float32)[:, None, :] * hi[None, :, :]
    y = tl.reduce(acc, 2, _SUM)                                              # [BM, BN]
    mask = mask_m[:, None] & mask_n[None, :]
    if not SPLIT:
        y = y / tl.load(gs_ptr)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:                                                                  # fp32 partial sums, reduced below
        tl.store(out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


@triton.jit
def _reduce_splits_kernel(part_ptr, gs_ptr, out_ptr, MN, SPLIT_K, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i] (in order of s) / global scale, for the MN = M * N outputs."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, (acc / tl.load(gs_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


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


# the GEMV kernel takes up to GEMV_ROWS rows; its (BLOCK_N, BLOCK_K, warps, stages) by rows padded to a power of two
# keep the [BM, BN, BK/2] accumulator at 4,096 fp32 values a program. nvfp4_matmul sends it the products of up to
# GEMV_DEFAULT_ROWS rows: none until a GPU sweep (bench/gpu_nvfp4.sh) has measured it against the tiled kernel
GEMV_ROWS = 16
GEMV_DEFAULT_ROWS = 0
GEMV_TILES = {1: (64, 128, 4, 3), 2: (32, 128, 4, 3), 4: (32, 64, 4, 3), 8: (16, 64, 4, 3), 16: (16, 32, 4, 3)}
PROGRAMS_PER_SM = 2                      # the K split aims at this many programs per multiprocessor


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 under the interpreter, so small tests split K too."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _checked(x: torch.Tensor, w: NVFP4Weight) -> bool:
    """Validates x against w and the device; True under TRITON_INTERPRET=1."""
    if x.shape[-1] != w.in_features:
        raise NVFP4ShapeError(f"x has {x.shape[-1]} features, the weight expects {w.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NVFP4ShapeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if x.device.type != "cuda" and not interpreting:
        raise NVFP4DeviceError("nvfp4_matmul needs CUDA tensors (or TRITON_INTERPRET=1); use "
                               "shared.quant.nvfp4_linear.nvfp4_linear on CPU")
    if w.packed.device != x.device or w.scale.device != x.device:
        raise NVFP4DeviceError(f"x is on {x.device} but the weight is on {w.packed.device}")
    return interpreting


def nvfp4_gemv(x: torch.Tensor, w: NVFP4Weight, block_n: int | None = None, block_k: int | None = None,
               split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None
               ) -> torch.Tensor:
    """x [..., K] with at most GEMV_ROWS rows -> [..., N] in x's dtype, through the GEMV kernel. split_k (how many
    programs share a row's K; by default enough for PROGRAMS_PER_SM programs a multiprocessor) is rounded to
    whole K tiles. Raises what nvfp4_matmul raises, and NVFP4ShapeError for more rows."""
    interpreting = _checked(x, w)
    x2 = x.reshape(-1, x.shape[-1])                                        # [M, K]
    m, k, n = x2.shape[0], w.in_features, w.out_features
    if not 0 < m <= GEMV_ROWS:
        raise NVFP4ShapeError(f"the GEMV kernel takes 1 to {GEMV_ROWS} rows, got {m}")
    block_m = triton.next_power_of_2(m)
    dn, dk, dw, ds = GEMV_TILES[block_m]
    block_n, block_k = block_n or dn, block_k or dk
    if any(b & (b - 1) for b in (block_n, block_k)) or block_k < 32:
        raise NVFP4ShapeError(f"block_n and block_k must be powers of two, block_k >= 32; got {block_n}, {block_k}")
    programs_n = triton.cdiv(n, block_n)
    tiles_k = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = triton.cdiv(PROGRAMS_PER_SM * _multiprocessors(x.device), programs_n)
    k_split = triton.cdiv(tiles_k, max(1, min(split_k, tiles_k))) * block_k  # whole tiles a program
    split_k = triton.cdiv(k, k_split)
    packed, scale = w.packed, w.scale.view(torch.uint8)                   # [N, K/2], [N, B] fp8 bits
    if packed.stride(1) != 1 or scale.stride(1) != 1:
        packed, scale = packed.contiguous(), scale.contiguous()
    # the interpreter truncates fp32 -> bf16 instead of rounding to nearest even: let torch do that cast there
    out = torch.empty((m, n), dtype=torch.float32 if interpreting else x.dtype, device=x.device)  # [M, N]
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    gs = w.global_scale if w.global_scale.device == x.device else w.global_scale.to(x.device)
    _nvfp4_gemv_kernel[(programs_n, split_k)](
        x2, packed, scale, gs, part, m, n, k, k_split,
        x2.stride(0), x2.stride(1), packed.stride(0), scale.stride(0), part.stride(0) if split_k > 1 else 0, n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split_k > 1,
        num_warps=num_warps or dw, num_stages=num_stages or ds,
    )
    if split_k > 1:
        _reduce_splits_kernel[(triton.cdiv(m * n, 1024),)](part, gs, out, m * n, split_k, BLOCK=1024)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def nvfp4_matmul(x: torch.Tensor, w: NVFP4Weight, block_m: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None
                 ) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32) -> [..., N] in x's dtype: the W4A16 product on CUDA (or the interpreter).

    Up to GEMV_DEFAULT_ROWS rows, and when no tile is given, the GEMV kernel (nvfp4_gemv) runs; else the tiled one.
    Raises NVFP4ShapeError on a K mismatch or a bad tile size and NVFP4DeviceError for CPU tensors outside
    TRITON_INTERPRET=1.
    """
    rows = x.numel() // max(1, x.shape[-1])
    if 0 < rows <= GEMV_DEFAULT_ROWS and block_m is None and block_n is None and block_k is None:
        return nvfp4_gemv(x, w, num_warps=num_warps, num_stages=num_stages)
    interpreting = _checked(x, w)
    dm, dn, dk, dw, ds = tiles_for(rows, x.dtype)
    if block_m is None and block_n is None and block_k is None:     # a tile given in part keeps the others' old
        num_warps = dw if num_warps is None else num_warps          # defaults, so explicit tiles mean the same
        num_stages = ds if num_stages is None else num_stages
        block_m, block_n, block_k = dm, dn, dk
    block_m, block_n, block_k = block_m or 32, block_n or 64, block_k or 64
    if any(b & (b - 1) for b in (block_m, block_n, block_k)) or min(block_m, block_n) < 16 or block_k < 32:
        raise NVFP4ShapeError(f"tile sizes must be powers of two, block_m and block_n >= 16, block_k >= 32; got "
                              f"{block_m}x{block_n}x{block_k}")
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
