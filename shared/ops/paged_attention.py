"""Attention over a paged KV cache: the torch reference (CPU) that every kernel is checked against.

Shapes: T = new tokens in the step (all sequences, flattened), B = sequences, H = query heads,
KVH = key/value heads, Dh = head dim, NB = physical blocks, BS = block size, MB = max blocks per sequence.

The cache of one layer is two tensors [NB, BS, KVH, Dh]. A sequence's block table maps its logical block
i to a physical block id; token position p of the sequence lives in slot block_table[p // BS] * BS + p % BS.

Token order in a step: the sequences with exactly one new token (decodes) come first, one row each, then
the sequences with several new tokens (prefill chunks, later speculative verification), contiguous.
New token j of sequence b sits at position seq_lens[b] - query_lens[b] + j and attends causally to every
cached position up to and including its own; a draft tree being verified attends as its mask says instead
(meta.tree_masks, shared.tree). With a sliding window W (Mistral, Gemma's local layers) a row at position p
attends only positions > p - W, its own included; a tree node's position is its root's plus its depth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor        # [B, MB] int64 (padded with 0)
    seq_lens: torch.Tensor            # [B] int64: tokens in the cache after this step
    query_start_loc: torch.Tensor     # [B + 1] int64: row of each sequence's first new token
    num_decodes: int                  # the first num_decodes sequences have one new token each
    query_lens: list[int]             # host copies, used to split the work on CPU
    seq_lens_host: list[int]
    max_query_len: int
    # Draft trees being verified (shared.tree): sequence index -> [Q, Q] bool mask among its new tokens
    # (row j may attend to new token i); those rows attend to the whole cached context and to the masked new tokens
    # instead of causally. Empty for plain steps.
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    tree_bits: torch.Tensor | None = None    # [T] int64, the Triton kernel's form of tree_masks (built on first use)
    cpu_rows: tuple | None = None            # the CPU kernel's row descriptors (shared.ops.cpu_attention, first use)
    row_positions: torch.Tensor | None = None  # [T] int64, each row's position, for sliding windows (first use)
    long_rope: list[bool] | None = None      # [B] LongRoPE past its window: the sequence is on the long factors
    prompt_chunks: list[bool] | None = None  # [B] the sequence's new tokens are prompt tokens (a prefill chunk)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores the new tokens' k, v [T, KVH, Dh] into their slots."""
    nb, bs, kvh, dh = k_cache.shape
    k_cache.view(nb * bs, kvh, dh).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, dh).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[NB, BS, KVH, Dh] gathered along block_tables [B, MB] -> [B, KVH, L, Dh] for the first L positions."""
    b = block_tables.shape[0]
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    x = cache[block_tables[:, :nblocks]]                     # [B, nblocks, BS, KVH, Dh]
    x = x.reshape(b, nblocks * bs, *cache.shape[2:])[:, :length]
    return x.transpose(1, 2)                                 # [B, KVH, L, Dh]


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  causal: bool = False) -> torch.Tensor:
    """Grouped-query attention: q [B, H, Q, Dh], k / v [B, KVH, L, Dh], mask [B or 1, 1, Q or 1, L] bool (True =
    attend) -> [B, H, Q, Dh]. Query head h reads KV head h // (H / KVH). The G = H / KVH heads of a group are
    folded into the query rows ([B, KVH, G Q, Dh]) rather than passed as enable_gqa: with a mask that takes
    SDPA's fused CPU kernel instead of its math fallback (about 5x faster for a decode step's one query)."""
    b, h, nq, dh = q.shape
    kvh = k.shape[1]
    g = h // kvh
    if g == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)
    qg = q.reshape(b, kvh, g * nq, dh)                       # row r of group j: head j G + r // Q, query r % Q
    if causal:                                               # causal over Q = L new tokens, as a mask per group
        mask = torch.ones(nq, nq, dtype=torch.bool, device=q.device).tril()[None, None]
    if mask is not None and mask.shape[-2] > 1:
        mask = mask.repeat(1, 1, g, 1)                       # [B, 1, G Q, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)     # [B, KVH, G Q, Dh]
    return out.reshape(b, h, nq, dh)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """One query per sequence: q [B, H, Dh] -> [B, H, Dh]."""
    k = _gather(k_cache, block_tables, max_len)              # [B, KVH, L, Dh]
    v = _gather(v_cache, block_tables, max_len)
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]   # [B, L]
    out = gqa_attention(q.unsqueeze(2).to(k.dtype), k, v, valid[:, None, None, :], scale)   # [B, H, 1, Dh]
    return out.squeeze(2)


def _extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            seq_len: int, scale: float, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Several new tokens of one sequence: q [Q, H, Dh] -> [Q, H, Dh], causal among themselves, or as the tree
    mask [Q, Q] says."""
    nq = q.shape[0]
    k = _gather(k_cache, block_table[None], seq_len)         # [1, KVH, L, Dh]
    v = _gather(v_cache, block_table[None], seq_len)
    qh = q.transpose(0, 1)[None].to(k.dtype)                 # [1, H, Q, Dh]
    if tree is not None:
        mask = torch.ones(nq, seq_len, dtype=torch.bool, device=q.device)           # [Q, L]
        mask[:, seq_len - nq:] = tree
        out = gqa_attention(qh, k, v, mask[None, None], scale)
    elif nq == seq_len:
        out = gqa_attention(qh, k, v, None, scale, causal=True)
    else:
        qpos = torch.arange(seq_len - nq, seq_len, device=q.device)[:, None]       # [Q, 1]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos             # [Q, L]
        out = gqa_attention(qh, k, v, mask[None, None], scale)
    return out[0].transpose(0, 1)                            # [Q, H, Dh]


def _short_extends(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   seqs: list[int], starts: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences with a few new tokens each (speculative verification), padded into one batch.
    Returns (out rows [N, H, Dh], their row indices [N])."""
    qlens = [meta.query_lens[b] for b in seqs]
    qmax, lmax = max(qlens), max(meta.seq_lens_host[b] for b in seqs)
    idx = torch.tensor(seqs, device=q.device)
    rows = [starts[b] + min(j, n - 1) for b, n in zip(seqs, qlens) for j in range(qmax)]   # pad: repeat the last
    row_idx = torch.tensor(rows, device=q.device)
    qb = q[row_idx].view(len(seqs), qmax, *q.shape[1:]).transpose(1, 2).to(k_cache.dtype)   # [B, H, Q, Dh]
    k = _gather(k_cache, meta.block_tables[idx], lmax)                                     # [B, KVH, L, Dh]
    v = _gather(v_cache, meta.block_tables[idx], lmax)
    seq_lens = meta.seq_lens[idx]                                                          # [B]
    qlen_t = torch.tensor(qlens, device=q.device)
    qpos = seq_lens[:, None] - qlen_t[:, None] + torch.arange(qmax, device=q.device)[None, :]   # [B, Q]
    kpos = torch.arange(lmax, device=q.device)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < seq_lens[:, None, None])
    for i, b in enumerate(seqs):                                                           # draft trees
        tree = meta.tree_masks.get(b)
        if tree is not None:
            n, end = qlens[i], meta.seq_lens_host[b]
            mask[i, :n, end - n:end] = tree
    out = gqa_attention(qb, k, v, mask[:, None], scale)                                   # [B, H, Q, Dh]
    valid = (torch.arange(qmax, device=q.device)[None, :] < qlen_t[:, None]).flatten()     # [B * Q]
    return out.transpose(1, 2).reshape(-1, *q.shape[1:])[valid], row_idx[valid]


MAX_TREE = 65   # new tokens of a draft tree (root + 64 nodes) the Triton kernel masks (an int64 of bits per row)
SHORT = 16      # sequences with at most this many new tokens are batched together


def row_positions(meta: AttentionMetadata) -> torch.Tensor:
    """[T] int64 on the host: each new token's position in its sequence (a tree node: its root's plus its depth)."""
    out = []
    for b, (n, length) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
        tree = meta.tree_masks.get(b)
        if tree is None:
            out.extend(range(length - n, length))
        else:
            out.extend((length - n + tree.cpu().sum(-1) - 1).tolist())     # a row attends its ancestors and itself
    return torch.tensor(out, dtype=torch.int64)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping (scores = cap tanh(scores / cap)), which SDPA lacks: q [1, H, Q,
    Dh], k / v [1, KVH, L, Dh], mask [Q, L] -> [1, H, Q, Dh], in fp32."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).float(), v.repeat_interleave(g, dim=1).float()       # [1, H, L, Dh]
    s = (q.float() @ k.transpose(-1, -2)) * scale                                           # [1, H, Q, L]
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _windowed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              window: int | None, softcap: float | None = None) -> torch.Tensor:
    """The reference one sequence at a time with explicit masks: the causal or tree mask, narrowed to a sliding
    window where there is one; soft-capped scores where `softcap` is set."""
    window = window or (1 << 62)
    out = torch.empty(q.shape, dtype=k_cache.dtype, device=q.device)
    pos = row_positions(meta).to(q.device)
    start = 0
    for b, (n, length) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
        k = _gather(k_cache, meta.block_tables[b][None], length)          # [1, KVH, L, Dh]
        v = _gather(v_cache, meta.block_tables[b][None], length)
        # each cached and new token's position (a tree node's: its root's plus its depth)
        kpos = torch.cat([torch.arange(length - n, device=q.device), pos[start:start + n]])[None, :]   # [1, L]
        qpos = pos[start:start + n, None]                                   # [Q, 1]
        mask = (kpos <= qpos) & (kpos > qpos - window)                      # [Q, L]
        tree = meta.tree_masks.get(b)
        if tree is not None:
            mask[:, length - n:] &= tree.to(q.device)
        qh = q[start:start + n].transpose(0, 1)[None].to(k.dtype)           # [1, H, Q, Dh]
        o = gqa_attention(qh, k, v, mask[None, None], scale) if softcap is None else \
            _softcapped(qh, k, v, mask, scale, softcap)
        out[start:start + n] = o[0].transpose(0, 1).to(out.dtype)
        start += n
    return out.to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """q [T, H, Dh] against the paged cache (already holding this step's K/V) -> [T, H, Dh]; `window`: each row
    attends its last `window` positions only; `softcap`: scores become softcap tanh(scores / softcap)."""
    if window or softcap:
        return _windowed(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty(q.shape, dtype=k_cache.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        max_len = max(meta.seq_lens_host[:nd])
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], max_len, scale)
    starts = [0] * len(meta.query_lens)
    start, short = nd, []
    for b in range(nd, len(meta.query_lens)):
        n = meta.query_lens[b]
        starts[b] = start
        if n <= SHORT:
            short.append(b)
        else:
            out[start:start + n] = _extend(q[start:start + n], k_cache, v_cache, meta.block_tables[b],
                                           meta.seq_lens_host[b], scale, meta.tree_masks.get(b))
        start += n
    if len(short) > 1:
        rows_out, rows = _short_extends(q, k_cache, v_cache, meta, short, starts, scale)
        out[rows] = rows_out
    elif short:
        b = short[0]
        n = meta.query_lens[b]
        out[starts[b]:starts[b] + n] = _extend(q[starts[b]:starts[b] + n], k_cache, v_cache, meta.block_tables[b],
                                               meta.seq_lens_host[b], scale, meta.tree_masks.get(b))
    return out.to(q.dtype)
