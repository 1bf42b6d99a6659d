"""Attention of a long prefill chunk (one sequence's many new tokens) over its paged cache.

Decode and verification rows go through shared.ops.cpu_attention one row at a time; a prefill chunk of hundreds
or thousands of rows is matrix work, and at long prompts it is most of a prefill's time (the scores grow with the
square of the length). Three paths, all exact against shared.ops.paged_attention.paged_attention_ref:

- bf16 caches on CPUs with AMX or AVX512-BF16: prefill_attention.c, flash-style (16 query rows of one head
  against blocks of 32 keys, the online softmax in fp32, blocks past a row's position or before its window never
  read), its products on AMX tiles where the CPU has them, else on AVX512-BF16 vectors.
- fp32 caches on CPUs with AVX2 and FMA: prefill_attention_f32.c, the same flash-style blocking on fp32 vectors
  (24 lanes of a key head's query heads and positions against blocks of 32 keys read in place from the cache).
- otherwise torch's fused SDPA (its flash kernel on CPU): the chunk's own keys causally (is_causal, the key
  heads repeated for each query head), the keys cached before it without a mask (a group's query heads folded
  into rows), the two merged by their log-sum-exps. A mask would make SDPA score every pair and convert the mask
  each call; this way nothing above the diagonal is computed.

Sliding windows take the kernel or the reference; soft-capped scores (Gemma 2) and draft trees the reference.
Shapes: n = new tokens, L = tokens in the cache after the step, H / KVH = query / key heads, Dh = head dim.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from shared.ops import c_build
from shared.ops.cpu_features import cpu_flags
from shared.ops.paged_attention import _gather
from shared.ops.rows_gemm_bf16 import AMX_FLAGS, FLAGS

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_suffix(".c")
SOURCE_F32 = Path(__file__).with_name("prefill_attention_f32.c")
F32_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGS = [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int, _I, ctypes.c_float, _I, ctypes.c_int]
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _amx_off() -> bool:
    return os.environ.get("UPESI_AMX", "1") in ("0", "false", "no")


@functools.cache
def _tiles_lib() -> ctypes.CDLL | None:
    """The kernel on AMX tiles where the CPU has AMX, the OS grants its tile state and UPESI_AMX is not 0."""
    if not {"amx_tile", "amx_bf16"} <= cpu_flags() or _amx_off():
        return None
    lib = c_build.load_or_none(SOURCE, AMX_FLAGS + ["-DUPESI_AMX_TILES"], "UPESI_PREFILL_ATTENTION",
                               "AMX prefill attention kernel")
    if lib is None:
        return None
    lib.upesi_prefill_amx_setup.restype = ctypes.c_int
    if lib.upesi_prefill_amx_setup() != 0:
        log.warning("the kernel refused this process AMX's tile state; prefill attention uses AVX-512 or SDPA")
        return None
    return _bind(lib)


@functools.cache
def _vector_lib() -> ctypes.CDLL | None:
    """The kernel on AVX512-BF16 vectors where the CPU has them."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_PREFILL_ATTENTION", "AVX512-BF16 prefill attention kernel")
    return None if lib is None else _bind(lib)


@functools.cache
def _f32_lib() -> ctypes.CDLL | None:
    """The fp32 kernel where the CPU has AVX2 and FMA."""
    if not {"avx2", "fma"} <= cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE_F32, F32_FLAGS, "UPESI_PREFILL_ATTENTION", "fp32 prefill attention kernel")
    if lib is None:
        return None
    lib.upesi_prefill_attention_f32.argtypes = _ARGS                  # the bf16 kernel's, with fp32 rows
    lib.upesi_prefill_attention_f32.restype = ctypes.c_int
    return lib


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.upesi_prefill_attention.argtypes = _ARGS
    lib.upesi_prefill_attention.restype = ctypes.c_int
    return lib


def kernels() -> dict[str, ctypes.CDLL]:
    """The builds that run here, by name ("amx", "avx512-bf16"), each ready to call."""
    return {name: lib for name, lib in (("amx", _tiles_lib()), ("avx512-bf16", _vector_lib())) if lib is not None}


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The build attention() calls: on tiles where they run, else on vectors, else none (torch's SDPA)."""
    return next(iter(kernels().values()), None)


def available(head_dim: int) -> bool:
    """Whether the kernel runs here for bf16 heads of this size (a multiple of 64, up to 256)."""
    return head_dim % 64 == 0 and head_dim <= 256 and _lib() is not None


def kernel() -> ctypes.CDLL | None:
    """The build attention() calls, for callers that reach upesi_prefill_attention from C (decoder_bf16.c)."""
    return _lib()


def f32_kernel(head_dim: int) -> int:
    """The address of upesi_prefill_attention_f32 for fp32 heads of this size, for C callers (decoder_f32.c), or 0
    where it does not run here."""
    lib = _f32_lib() if head_dim % 4 == 0 and head_dim <= 256 else None
    return 0 if lib is None else ctypes.cast(lib.upesi_prefill_attention_f32, ctypes.c_void_p).value


def on_tiles(head_dim: int) -> bool:
    """Whether the kernel runs on AMX tiles here (then prompt chunks of a few dozen rows pay on it too)."""
    return available(head_dim) and _lib() is _tiles_lib()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these rows: bf16 on CPU, heads contiguous, a head size it takes."""
    return (q.dtype == k_cache.dtype == torch.bfloat16 and q.device.type == "cpu" and q.stride(2) == 1
            and q.stride(1) == q.shape[-1] and available(q.shape[-1]))


def supports_f32(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the fp32 kernel takes these rows: fp32 on CPU, heads contiguous, a head size a multiple of 4 up to
    256, the kernel built here."""
    return (q.dtype == k_cache.dtype == torch.float32 and q.device.type == "cpu" and q.stride(2) == 1
            and q.stride(1) == q.shape[-1] and q.shape[-1] % 4 == 0 and q.shape[-1] <= 256
            and _f32_lib() is not None)


def takes_window(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether attention() runs a sliding window for these rows on a kernel (else the caller takes the reference)."""
    return supports(q, k_cache) or supports_f32(q, k_cache)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int, scale: float, window: int | None = None) -> torch.Tensor:
    """q [n, H, Dh] (rotated; its n tokens are the last of the seq_len the cache holds) -> [n, H, Dh], each row
    attending causally (within `window` positions where given). block_table [MB] int64."""
    fn = _lib().upesi_prefill_attention if supports(q, k_cache) else \
        _f32_lib().upesi_prefill_attention_f32 if supports_f32(q, k_cache) else None
    if fn is not None:
        n, h, dh = q.shape
        out = torch.empty(n, h, dh, dtype=q.dtype)
        table = block_table if block_table.dtype == torch.int64 and block_table.is_contiguous() else \
            block_table.to(torch.int64).contiguous()
        rc = fn(q.data_ptr(), q.stride(0), out.data_ptr(), h * dh, k_cache.data_ptr(), v_cache.data_ptr(),
                table.data_ptr(), k_cache.shape[1], n, seq_len, h, k_cache.shape[2], dh, scale, window or 0,
                torch.get_num_threads())
        if rc == 0:
            return out
    if window:
        raise ValueError("a sliding window needs the prefill kernel or the reference")
    return _sdpa(q, k_cache, v_cache, block_table, seq_len, scale)


def _sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
          scale: float) -> torch.Tensor:
    """Torch's flash kernel: the diagonal block causally, the cached prefix unmasked, merged by log-sum-exp."""
    n, h, dh = q.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    k = _gather(k_cache, block_table[None], seq_len)                      # [1, KVH, L, Dh]
    v = _gather(v_cache, block_table[None], seq_len)
    qh = q.transpose(0, 1)[None].to(k.dtype)                              # [1, H, n, Dh]
    p = seq_len - n
    kd, vd = k[:, :, p:], v[:, :, p:]
    if g > 1:
        kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)   # [1, H, n, Dh]
    o, lse = _flash(qh, kd, vd, is_causal=True, scale=scale)              # [1, H, n, Dh], [1, H, n]
    if p:
        o1, lse1 = _flash(qh.reshape(1, kvh, g * n, dh), k[:, :, :p], v[:, :, :p], scale=scale)
        o1, lse1 = o1.reshape(1, h, n, dh), lse1.reshape(1, h, n)
        top = torch.maximum(lse, lse1)
        w, w1 = torch.exp(lse - top)[..., None], torch.exp(lse1 - top)[..., None]
        o = ((o.float() * w + o1.float() * w1) / (w + w1)).to(k.dtype)
    return o[0].transpose(0, 1)                                           # [n, H, Dh]
