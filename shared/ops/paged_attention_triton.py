"""Triton paged attention: one kernel for decodes, prefill chunks and speculative verification (causal new tokens,
or a draft tree's ancestor masks).

Shapes: T = new tokens in the step (flattened), B = sequences, H = query heads, KVH = key/value heads,
G = H // KVH (query heads per kv head), Dh = head dim, NB = physical blocks, BS = block size, MB = max blocks.
Reference: shared.ops.paged_attention.paged_attention_ref (same contract); tests/unit/test_paged_attention_triton.py
compares the two under TRITON_INTERPRET=1.

Work split: one program per (sequence, query tile, kv head). A query tile holds BLOCK_Q new tokens of one sequence
times the G query heads that share a kv head, so every K/V tile read from the cache serves all of them (GQA):

    row r of the [BLOCK_M, Dh] q tile  ->  token qi = r // G_PAD, head kvh * G + r % G_PAD   (G_PAD = next pow2 of G)

The program walks the sequence's positions [0, last causal position of the tile] in BLOCK_N steps, maps each
position p to its slot through the block table (block_tables[b, p // BS] * BS + p % BS), and folds the tile into
an online softmax (running max m, running sum l, fp32 accumulator), FlashAttention-2 style. A decode is a tile
with one valid token; a chunk with prior context just starts its causal diagonal at seq_len - query_len.
Draft trees (meta.tree_masks): every new-token row carries a 64-bit mask of the tree nodes it may attend
(`tree_bits`: bit i = new token i + 1; new token 0, the root, is attended by every row; -1 = all, the rows of
sequences without a tree); a tree's nodes come after their ancestors, so the tree mask only narrows the causal one,
and the walk over positions stays the same. So a tree of up to 64 nodes (MAX_TREE = 65 new tokens) runs here.
There is no split over the KV axis: a decode batch launches B * KVH programs, which fills an H200 from a few
dozen sequences on; very long contexts at tiny batch would want a split-KV pass and a reduction.

Napkin math (decode, memory-bound): per sequence and layer the kernel reads 2 * L * KVH * Dh * 2 B of bf16 K/V;
32 sequences x 1024 positions x 8 kv heads x 128 dims -> 134 MB, ~28 us at an H200's ~4.8 TB/s.

Numerics: scores, softmax and the accumulator are fp32; q is cast to the cache dtype like the reference. On GPU,
bf16/fp16 tiles go to tl.dot as they are (p is rounded to the cache dtype for the PV product, as in FlashAttention)
and fp32 tiles use input_precision="ieee" (no tf32). The interpreter cannot tl.dot bf16 operands
(triton-lang/triton#11584), so under TRITON_INTERPRET=1 every tile is upcast to fp32 first; it also truncates
fp32 -> bf16 casts, so there the kernel stores fp32 and torch rounds the output.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shared.ops.paged_attention import MAX_TREE, AttentionMetadata, row_positions

LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)
# tl.max / tl.sum are @jit wrappers around these: calling them breaks the interpreter when triton was imported before
# TRITON_INTERPRET was set (like tl.zeros), while tl.reduce is a builtin and the interpreter maps these to numpy
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine
_MIN = tl.standard._elementwise_min


class PagedAttentionError(ValueError):
    """Shapes, dtypes or devices the kernel cannot take; a ValueError so callers can map it to INVALID_ARGUMENT."""


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, bits_ptr, pos_ptr,
    qk_scale,                                                   # softmax scale * log2(e): scores go through exp2
    window,                                                     # sliding window (read with HAS_WINDOW)
    softcap,                                                    # Gemma 2's score cap (read with HAS_SOFTCAP)
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,                 # k and v caches share one layout
    stride_btb, stride_btm,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    b = tl.program_id(0)
    qb = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if qb * BLOCK_Q < q_len:                                    # tiles past this sequence's new tokens do nothing
        offs_m = tl.arange(0, BLOCK_M)                          # [BM]
        qi = qb * BLOCK_Q + offs_m // G_PAD                     # [BM] index among the sequence's new tokens
        g = offs_m % G_PAD
        row_ok = (qi < q_len) & (g < G)                         # [BM]
        q_pos = seq_len - q_len + qi                            # [BM] position of each row's token
        if HAS_TREE:
            bits = tl.load(bits_ptr + q_start + qi, mask=row_ok, other=-1)               # [BM] int64
        offs_d = tl.arange(0, D_PAD)                            # [D]
        d_ok = offs_d < HEAD_DIM

        q_rows = (q_start + qi) * stride_qt + (kvh * G + g) * stride_qh              # [BM]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)                  # [BM, D]
        q = q.to(k_ptr.dtype.element_ty)
        if DOT_F32:
            q = q.to(tl.float32)

        # a finite floor, not -inf: fully masked rows then give exp2(-inf - floor) = 0, never inf - inf = nan
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)         # [BM] running max (log2 units)
        l_i = tl.full((BLOCK_M,), 0.0, tl.float32)             # [BM] running sum of exp2
        acc = tl.full((BLOCK_M, D_PAD), 0.0, tl.float32)       # [BM, D]

        kv_end = tl.minimum(seq_len, seq_len - q_len + (qb + 1) * BLOCK_Q)   # past the tile's last causal position
        kv_start = 0
        if HAS_WINDOW:                                          # each row attends (its position - window, ...]
            row_lo = tl.load(pos_ptr + q_start + qi, mask=row_ok, other=0) - window + 1                # [BM]
            tile_lo = tl.reduce(tl.where(row_ok, row_lo, 1 << 40), 0, _MIN)
            kv_start = (tl.maximum(tile_lo, 0) // BLOCK_N) * BLOCK_N       # blocks before every row's window: skipped
        offs_n = tl.arange(0, BLOCK_N)                          # [BN]
        for start in range(kv_start, kv_end, BLOCK_N):
            pos = start + offs_n                                # [BN] logical positions
            pos_ok = pos < kv_end
            block = tl.load(bt_ptr + b * stride_btb + (pos // BLOCK_SIZE) * stride_btm, mask=pos_ok, other=0)
            kv_rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch             # [BN]
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_rows[:, None] + offs_d[None, :] * stride_cd, mask=kv_mask, other=0.0)  # [BN, D]
            v = tl.load(v_ptr + kv_rows[:, None] + offs_d[None, :] * stride_cd, mask=kv_mask, other=0.0)  # [BN, D]
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")    # [BM, BN]
            else:
                s = tl.dot(q, tl.trans(k))
            causal = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]              # [BM, BN]
            if HAS_TREE:
                rel = pos - (seq_len - q_len)                   # [BN] index among the new tokens (< 0: context)
                shift = tl.minimum(tl.maximum(rel - 1, 0), 63).to(tl.int64)
                bit = (bits[:, None] >> shift[None, :]) & 1                          # [BM, BN]
                causal = causal & ((rel[None, :] <= 0) | (rel[None, :] > 64) | (bit != 0))
            if HAS_WINDOW:
                kpos = pos                                      # [BN] a tree node's position: root + its depth
                if HAS_TREE:
                    new = (pos >= seq_len - q_len) & pos_ok
                    kpos = tl.where(new, tl.load(pos_ptr + q_start + pos - (seq_len - q_len), mask=new, other=0), pos)
                causal = causal & (kpos[None, :] >= row_lo[:, None])
            if HAS_SOFTCAP:                                     # cap tanh(s scale / cap), then to log2 units
                y = s * (qk_scale / LOG2E_C) / softcap
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * LOG2E_C
            else:
                s = s * qk_scale
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))                               # [BM]
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])                                          # [BM, BN]
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            if DOT_F32:
                acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")  # [BM, D]
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]                           # padding rows have l = 0
        o_rows = (q_start + qi) * stride_ot + (kvh * G + g) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def tree_bits(meta: AttentionMetadata) -> torch.Tensor:
    """meta.tree_masks -> [T] int64: row t's bit i set = t may attend its sequence's new token i + 1 (every row
    attends new token 0, the tree's root); -1 (every bit) for rows of sequences without a tree. Raises
    PagedAttentionError for a tree of more than MAX_TREE new tokens or a row that does not attend the root."""
    bits = torch.full((int(meta.query_start_loc[-1]),), -1, dtype=torch.int64)             # [T]
    starts = meta.query_start_loc.tolist()
    for b, mask in meta.tree_masks.items():                                                 # mask [Q, Q] bool
        n = mask.shape[0]
        mask = mask.cpu()
        if n > MAX_TREE or not mask[:, 0].all():
            raise PagedAttentionError(f"the kernel takes draft trees of at most {MAX_TREE} new tokens whose rows "
                                      f"all attend the root; got {n} new tokens")
        weights = torch.ones(n - 1, dtype=torch.int64) << torch.arange(n - 1, dtype=torch.int64)   # bit 63: the sign
        bits[starts[b]:starts[b] + n] = (mask[:, 1:].long() * weights).sum(-1)
    return bits.to(meta.query_start_loc.device)


def _tiles(group: int, max_query_len: int, block_n: int | None) -> tuple[int, int, int]:
    """-> (G_PAD, BLOCK_Q, BLOCK_N): q tiles of 16..64 rows (tl.dot wants >= 16), KV tiles of 64 positions by
    default (the gather goes position by position, so a KV tile need not align with cache blocks)."""
    g_pad = triton.next_power_of_2(group)
    rows = min(max(16, g_pad * triton.next_power_of_2(max_query_len)), max(64, g_pad))
    return g_pad, rows // g_pad, block_n if block_n is not None else 64


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, block_n: int | None = None,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, Dh] against the paged cache (already holding this step's K/V) -> [T, H, Dh] in q's dtype.

    Same contract as paged_attention_ref; runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1. block_n (a
    power of two >= 16) overrides the number of KV positions per inner step; `window`: a sliding window of that many
    positions; `softcap`: scores become softcap tanh(scores / softcap). Raises PagedAttentionError on bad shapes,
    dtypes or devices.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise PagedAttentionError(f"need q [T, H, Dh] and k/v caches [NB, BS, KVH, Dh] of one shape and dtype; got "
                                  f"q {tuple(q.shape)}, k {tuple(k_cache.shape)} {k_cache.dtype}, "
                                  f"v {tuple(v_cache.shape)} {v_cache.dtype}")
    t, h, dh = q.shape
    _, bs, kvh, cache_dh = k_cache.shape
    if cache_dh != dh or h % kvh:
        raise PagedAttentionError(f"q has {h} heads of {dh} dims; the cache has {kvh} kv heads of {cache_dh} dims "
                                  f"(heads must be a multiple of kv heads)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PagedAttentionError(f"q must be fp32, bf16 or fp16, got {q.dtype}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise PagedAttentionError(f"block_n must be a power of two >= 16, got {block_n}")
    if v_cache.stride() != k_cache.stride():
        raise PagedAttentionError("k and v caches must share one memory layout")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if q.device.type != "cuda" and not interpreting:
        raise PagedAttentionError("paged_attention_triton needs CUDA tensors (or TRITON_INTERPRET=1); use "
                                  "shared.ops.paged_attention.paged_attention_ref on CPU")
    if k_cache.device != q.device or meta.block_tables.device != q.device:
        raise PagedAttentionError(f"q is on {q.device}, the cache on {k_cache.device}, the block tables on "
                                  f"{meta.block_tables.device}")
    num_seqs = len(meta.query_lens)
    # the interpreter truncates fp32 -> bf16 instead of rounding to nearest even: let torch do that cast there
    out = torch.empty((t, h, dh), dtype=torch.float32 if interpreting else q.dtype, device=q.device)  # [T, H, Dh]
    if t == 0 or num_seqs == 0:
        return out.to(q.dtype)
    bits = None
    if meta.tree_masks:
        if meta.tree_bits is None:                              # once per step: every layer shares the metadata
            meta.tree_bits = tree_bits(meta)
        bits = meta.tree_bits
    positions = None
    if window:
        if meta.row_positions is None:                          # once per step, as tree_bits
            meta.row_positions = row_positions(meta).to(q.device)
        positions = meta.row_positions
    g_pad, block_q, bn = _tiles(h // kvh, meta.max_query_len, block_n)
    bt = meta.block_tables                                                  # [B, MB]
    grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), kvh)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, bt, meta.seq_lens, meta.query_start_loc,
        bits if bits is not None else meta.seq_lens,                        # (not read without a tree)
        positions if positions is not None else meta.seq_lens,              # (not read without a window)
        scale * LOG2E, window or 0, float(softcap or 0.0),
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        bt.stride(0), bt.stride(1),
        G=h // kvh, G_PAD=g_pad, HEAD_DIM=dh, D_PAD=max(16, triton.next_power_of_2(dh)), BLOCK_SIZE=bs,
        BLOCK_Q=block_q, BLOCK_N=bn,
        DOT_F32=interpreting or k_cache.dtype == torch.float32, HAS_TREE=bits is not None,
        HAS_WINDOW=positions is not None, HAS_SOFTCAP=bool(softcap),
    )
    return out.to(q.dtype)
