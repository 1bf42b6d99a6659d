"""Paged attention and RoPE + KV store on CPU in C (cpu_attention.c), for the rows of decodes, verifications and
short prefill chunks; the torch reference (shared.ops.paged_attention) is what it is tested against.

A decode step of the default model spends more time in the glue around attention than in it: per layer the torch
path gathers every cached block of K and of V into new tensors, builds a mask, splits, rotates and stores K/V in a
dozen small ops (close to a third of a layer's time at batch 1: docs/performance.md). The C kernel reads K/V in place
through the block table, one query row at a time, positions in order, so a row's result does not depend on the
rows beside it (a verification row equals the decode row it stands for). Sequences with more than MAX_ROWS new
tokens (long prefill chunks) go to shared.ops.prefill_attention, matrix work on tiles.

Built with shared.ops.c_build at first use; where it cannot run (no compiler, UPESI_CPU_ATTENTION=0, a self-check
that disagrees with the reference) `available()` is False and the torch path runs.
Shapes: T = rows of the step, H / KVH = query / kv heads, Dh = head dim, B = sequences, R = rows given to C.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from shared.ops import c_build, prefill_attention
from shared.ops.cpu_features import cpu_flags
from shared.ops.paged_attention import AttentionMetadata, _extend, paged_attention_ref

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
MAX_ROWS = 65          # new tokens of one sequence handled in C (a draft tree of 64 nodes and its root)
_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_CPU_ATTENTION", "CPU attention kernel")
    if lib is None:
        return None
    lib.upesi_rope_store.argtypes = [_P, _I, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, _P, _P, _P,
                                     _P, _P, ctypes.c_int]
    lib.upesi_paged_attention.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, ctypes.c_int, _P, _P, _I, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, _I, _I, _I,
                                          ctypes.c_float]
    for fn in (lib.upesi_rope_store, lib.upesi_paged_attention):
        fn.restype = None
    lib.upesi_attention_avx512.argtypes, lib.upesi_attention_avx512.restype = [ctypes.c_int], None
    lib.upesi_attention_avx512(int(avx512_default()))
    lib.upesi_rope_avx512.argtypes, lib.upesi_rope_avx512.restype = [ctypes.c_int], ctypes.c_int
    return lib


def avx512_default() -> bool:
    """The bf16 cache's AVX-512 path where the CPU has AVX512-BF16, unless UPESI_ATTENTION_AVX512 is 0."""
    return "avx512_bf16" in cpu_flags() and os.environ.get("UPESI_ATTENTION_AVX512", "1") not in ("0", "false", "no")


def set_avx512(on: bool) -> None:
    """Whether bf16 rows (head dims a multiple of 32) take the AVX-512 path from now on, in this process."""
    _lib().upesi_attention_avx512(int(on))


def rope_avx512(on: bool) -> bool:
    """Chooses rope_store's AVX-512 path (where the CPU has it) or its AVX2 one; returns whether AVX-512 runs. Both
    give the same bits; the choice exists for tests."""
    return bool(_lib().upesi_rope_avx512(int(on)))


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C kernels take q [T, H, Dh] against this cache [NB, BS, KVH, Dh]: CPU, fp32 or bf16 alike, head
    dim a multiple of 8 and at most 512, at most 8 query heads per KV head."""
    h, dh = q.shape[-2], q.shape[-1]
    kvh = k_cache.shape[2]
    return (q.device.type == "cpu" and k_cache.dtype == q.dtype and q.dtype in (torch.float32, torch.bfloat16)
            and dh % 8 == 0 and dh <= 512 and h % kvh == 0 and h // kvh <= 8 and available())


@functools.cache
def available() -> bool:
    """True where the kernel builds, loads and agrees with the torch reference on a small mixed step."""
    if _lib() is None:
        return False
    ok = _agrees()
    if not ok:
        log.warning("CPU attention kernel disagrees with the torch reference on this machine; using torch")
    elif avx512_default() and not _agrees_avx512():
        log.warning("CPU attention's AVX-512 path disagrees with the torch reference on this machine; not using it")
        set_avx512(False)
    return ok


def _check_step() -> AttentionMetadata:
    """The self-checks' step over 8 blocks of 4: a decode (7 tokens), a 5-token chain (9) and a 3-node tree (6)."""
    from shared.tree import ancestor_mask
    lens, qlens = [7, 9, 6], [1, 5, 4]
    return AttentionMetadata(
        slot_mapping=torch.tensor([10, 21, 22, 23, 24, 25, 28, 29, 30, 31]),
        block_tables=torch.tensor([[2, 1, 0], [3, 4, 5], [6, 7, 0]]), seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor([0, 1, 6, 10]), num_decodes=1, query_lens=qlens, seq_lens_host=lens,
        max_query_len=5, tree_masks={2: ancestor_mask([-1, -1, 0])})


def _agrees_avx512() -> bool:
    """The AVX-512 path on a bf16 step (a decode, a 5-token chain, a 3-node tree, head dim 64) within 2e-2 of the
    reference."""
    g = torch.Generator().manual_seed(1)
    nb, bs, kvh, h, dh = 8, 4, 2, 6, 64
    kc = torch.randn(nb, bs, kvh, dh, generator=g).bfloat16()
    vc = torch.randn(nb, bs, kvh, dh, generator=g).bfloat16()
    meta = _check_step()
    q = torch.randn(10, h, dh, generator=g).bfloat16()
    got = paged_attention(q, kc, vc, meta, 0.125).float()
    return torch.allclose(got, paged_attention_ref(q, kc, vc, meta, 0.125).float(), rtol=2e-2, atol=2e-2)


def _agrees() -> bool:
    """A step of a decode, a 5-token chain and a 3-node draft tree over 2 KV heads x 2 query heads each, fp32: the
    kernel's attention within 1e-5 of the reference and its RoPE + store equal to apply_rope + write_kv, in fp32 and
    bf16, rotating every dim of a head or half of them (a partial rotary factor)."""
    from shared.ops.paged_attention import write_kv
    from shared.ops.rope import apply_rope
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, h, dh = 8, 4, 2, 4, 16
    kc, vc = torch.randn(nb, bs, kvh, dh, generator=g), torch.randn(nb, bs, kvh, dh, generator=g)
    meta = _check_step()
    q = torch.randn(10, h, dh, generator=g)
    if not torch.allclose(paged_attention(q, kc, vc, meta, 0.25), paged_attention_ref(q, kc, vc, meta, 0.25),
                          rtol=1e-5, atol=1e-5):
        return False
    qkv = torch.randn(10, (h + 2 * kvh) * dh, generator=g)
    for dtype, rot in [(d, r) for d in (torch.float32, torch.bfloat16) for r in (dh, dh // 2)]:   # partial rotary
        cos, sin = torch.randn(10, rot, generator=g), torch.randn(10, rot, generator=g)
        x, c, s = qkv.to(dtype), cos.to(dtype), sin.to(dtype)
        k1, v1, k2, v2 = kc.to(dtype), vc.to(dtype), kc.to(dtype), vc.to(dtype)
        qr, kr, v = x.split([h * dh, kvh * dh, kvh * dh], dim=-1)
        want_q = apply_rope(qr.reshape(10, h, dh), c, s)
        write_kv(k1, v1, apply_rope(kr.reshape(10, kvh, dh), c, s), v.reshape(10, kvh, dh), meta.slot_mapping)
        got = x.clone()
        rope_store(got, c, s, k2, v2, meta.slot_mapping, h, kvh, dh)
        if not (torch.equal(got[:, :h * dh].view(10, h, dh), want_q) and torch.equal(k1, k2)
                and torch.equal(v1, v2)):
            return False
    return True


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, h: int, kvh: int, dh: int) -> None:
    """qkv [T, (H + 2 KVH) Dh] (contiguous rows): q and k rotated in place by cos / sin [T, R] (the qkv dtype; R <
    Dh: partial rotary, the first R dims), then k and v stored at slots [T] of the caches [NB, BS, KVH, Dh]."""
    t = qkv.shape[0]
    if t == 0:
        return
    _lib().upesi_rope_store(qkv.data_ptr(), t, qkv.stride(0), h, kvh, dh, cos.shape[-1], cos.contiguous().data_ptr(),
                            sin.contiguous().data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                            int(qkv.dtype == torch.bfloat16))


TILED_ROWS = 8         # prompt chunks of this many rows or more and at least TILED_WORK rows x positions go to the
TILED_WORK = 8192      # prefill kernel on AMX tiles (2 threads: 16 rows at 3,000 positions 0.74 ms a layer against
                       # 1.71 row by row)
VECTOR_ROWS = 16       # the same on AVX512-BF16 vectors, from a whole tile of 16 query rows (16 rows at 1,000
                       # positions 0.19 ms a layer against 0.22; 8 rows at 2,000 0.35 against 0.27)
                       # fp32 rows (prefill_attention_f32.c) as on tiles: 8 rows at 2,000 positions 0.36 ms a layer
                       # against 0.53, 16 at 5,000 1.8 against 3.0
ROW_BLOCK = 8          # a sequence's rows per work item (a 9-row verification: blocks of 5 and 4, both threads busy)


def row_descriptors(meta: AttentionMetadata, tiled: bool = False,
                    fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int], int, int]:
    """Once per step (the layers share it): [R, 5] int64 (row, sequence, cached positions before its new tokens,
    index among them, tree bits) of the rows C computes, [NB, 2] (first row, rows) of their blocks (rows of one
    sequence), (sequence, first row) of the long chunks (`tiled`: prompt chunks from TILED_ROWS rows on too), the
    longest sequence among the C rows and the most rows of a block."""
    if meta.cpu_rows is None:
        desc, blocks, long, start, longest, widest = [], [], [], 0, 0, 1
        to_tiles = tiled_chunks(meta, fp32) if tiled else set()
        for b, (n, length) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
            if n > MAX_ROWS or b in to_tiles:
                long.append((b, start))
            else:
                tree = meta.tree_masks.get(b)
                bits = [-1] * n if tree is None else _tree_bits(tree.cpu())
                parts = -(-n // ROW_BLOCK)
                for i in range(parts):                    # n rows in `parts` blocks of nearly equal size
                    lo, hi = i * n // parts, (i + 1) * n // parts
                    blocks.append((len(desc) + lo, hi - lo))
                    widest = max(widest, hi - lo)
                desc.extend((start + j, b, length - n, j, bits[j]) for j in range(n))
                longest = max(longest, length)
            start += n
        meta.cpu_rows = (torch.tensor(desc, dtype=torch.int64).view(-1, 5),
                         torch.tensor(blocks, dtype=torch.int64).view(-1, 2), long, longest, widest)
    return meta.cpu_rows


def tiled_chunks(meta: AttentionMetadata, fp32: bool = False) -> set[int]:
    """Sequences of the step whose rows (a prompt chunk of at most MAX_ROWS rows, no tree) pay on the prefill
    kernel rather than row by row (longer chunks always go there), where it runs for these heads (fp32: the fp32
    kernel's rows)."""
    prompts = meta.prompt_chunks or []
    least = TILED_ROWS if fp32 or prefill_attention.on_tiles(64) else VECTOR_ROWS
    return {b for b, (n, length, prompt) in enumerate(zip(meta.query_lens, meta.seq_lens_host, prompts))
            if prompt and least <= n <= MAX_ROWS and n * length >= TILED_WORK and b not in meta.tree_masks}


def _tree_bits(mask: torch.Tensor) -> list[int]:
    """[Q, Q] bool tree mask -> per row an int64 whose bit i says it attends new token i + 1 (all attend token 0)."""
    out = []
    for row in mask.tolist():
        bits = sum(1 << (i - 1) for i, on in enumerate(row) if i and on)
        out.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, Dh] (rows may be strided, heads contiguous) against the paged cache -> [T, H, Dh]; `window`: a
    sliding window of that many positions (tiles before every row's window are not read); `softcap`: scores
    become softcap tanh(scores / softcap) (Gemma 2)."""
    t, h, dh = q.shape
    if q.stride(2) != 1 or q.stride(1) != dh:
        q = q.contiguous()
    out = torch.empty(t, h, dh, dtype=q.dtype)
    tiled = not softcap and (prefill_attention.supports(q, k_cache) or prefill_attention.supports_f32(q, k_cache))
    rows, blocks, long, longest, widest = row_descriptors(meta, tiled, q.dtype == torch.float32)
    if len(rows):
        bt = meta.block_tables
        _lib().upesi_paged_attention(q.data_ptr(), q.stride(0), out.data_ptr(), h * dh, k_cache.data_ptr(),
                                     v_cache.data_ptr(), bt.data_ptr(), bt.shape[1], k_cache.shape[1],
                                     rows.data_ptr(), blocks.data_ptr(), len(blocks), h, k_cache.shape[2], dh,
                                     scale, int(q.dtype == torch.bfloat16), longest, widest, window or 0,
                                     softcap or 0.0)
    for b, lo in long:
        n = meta.query_lens[b]
        if b not in meta.tree_masks and not softcap and (not window or prefill_attention.takes_window(q, k_cache)):
            out[lo:lo + n] = prefill_attention.attention(q[lo:lo + n], k_cache, v_cache, meta.block_tables[b],
                                                         meta.seq_lens_host[b], scale, window)
            continue
        if window or softcap:                       # a long chunk with a window or a cap: the reference, its rows
            one = AttentionMetadata(meta.slot_mapping[lo:lo + n], meta.block_tables[b:b + 1],
                                    meta.seq_lens[b:b + 1], torch.tensor([0, n]), 0, [n],
                                    [meta.seq_lens_host[b]], n, {0: meta.tree_masks[b]} if b in meta.tree_masks else {})
            out[lo:lo + n] = paged_attention_ref(q[lo:lo + n], k_cache, v_cache, one, scale, window, softcap)
            continue
        out[lo:lo + n] = _extend(q[lo:lo + n], k_cache, v_cache, meta.block_tables[b], meta.seq_lens_host[b],
                                 scale, meta.tree_masks.get(b))
    return out
