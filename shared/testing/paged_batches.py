"""Ragged paged-attention batches for the kernel tests (CPU interpreter and CUDA): decodes, prompts, chunks after
cached context and verifications, with partly filled last blocks and block tables that share physical blocks."""
from __future__ import annotations

import torch

from shared.ops.paged_attention import AttentionMetadata, write_kv

# (seq_len after the step, new tokens): 4 decodes (a 1-token sequence, a full block + 1, a partial block, exactly
# one block), then a whole 20-token prompt, a 13-token chunk after 37 cached, and two K+1 = 4 verifications
MIXED = [(1, 1), (17, 1), (40, 1), (16, 1), (20, 20), (50, 13), (37, 4), (19, 4)]
SHARE = [(2, 5, 2), (6, 2, 2)]   # (seq, from seq, blocks): seq's first blocks are the other's physical blocks


def make_batch(lens: list[tuple[int, int]], share: list[tuple[int, int, int]], h: int, kvh: int, dh: int,
               bs: int, dtype: torch.dtype = torch.float32, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """-> q [T, H, Dh], k/v caches [NB, BS, KVH, Dh] holding this step's K/V, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [(n + bs - 1) // bs for n, _ in lens]
    num_blocks = sum(nblocks) + 3                                   # spare blocks hold junk nobody may read
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[ids.pop() for _ in range(nb)] for nb in nblocks]
    for dst, src, n in share:                                       # only whole blocks of cached context
        assert n * bs <= min(lens[dst][0] - lens[dst][1], lens[src][0] - lens[src][1])
        tables[dst][:n] = tables[src][:n]
    mb = max(nblocks) + 1                                           # a padding column of zeros at least
    block_tables = torch.tensor([t + [0] * (mb - len(t)) for t in tables], dtype=torch.int64)  # [B, MB]

    k_cache = torch.randn(num_blocks, bs, kvh, dh, generator=g).to(dtype)                      # the cached context
    v_cache = torch.randn(num_blocks, bs, kvh, dh, generator=g).to(dtype)
    slots = [tables[b][p // bs] * bs + p % bs for b, (n, q) in enumerate(lens) for p in range(n - q, n)]
    t = len(slots)
    q_lens = [q for _, q in lens]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),                                   # [T]
        block_tables=block_tables,
        seq_lens=torch.tensor([n for n, _ in lens], dtype=torch.int64),                        # [B]
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64),  # [B + 1]
        num_decodes=next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens)),
        query_lens=q_lens,
        seq_lens_host=[n for n, _ in lens],
        max_query_len=max(q_lens),
    )
    write_kv(k_cache, v_cache, torch.randn(t, kvh, dh, generator=g), torch.randn(t, kvh, dh, generator=g),
             meta.slot_mapping)
    q = torch.randn(t, h, dh, generator=g).to(dtype)                                           # [T, H, Dh]
    return q, k_cache, v_cache, meta


def random_parents(n: int, seed: int) -> list[int]:
    """A random draft tree of n nodes in depth order (each node's parent comes before it; -1 = the root)."""
    rng = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(-1, i, (1,), generator=rng)) for i in range(1, n)]
