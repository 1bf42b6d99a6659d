"""Content addresses of full KV blocks: a hash chain over the tokens, the same in every process.

    h0 = H(ROOT, tokens[0:16], extra)   h1 = H(h0, tokens[16:32], extra)   ...

`extra` names the model and the request's cache salt, so two models or tenants never share a block. The router
computes the same chain from a prompt to ask the registry which replica holds its longest prefix, so the hash
must not depend on the process (Python's str hash does): it is BLAKE2b, cut to 63 bits (fits Redis and int64).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import NewType

BlockHash = NewType("BlockHash", int)  # 64-bit content hash of one full KV block (chained through its parent)

ROOT = BlockHash(0)


def cache_extra(model: str, cache_salt: str = "") -> bytes:
    return f"{model}\x00{cache_salt}".encode()


def hash_block(parent: BlockHash, tokens: list[int], extra: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return BlockHash(int.from_bytes(h.digest(), "little") >> 1)


def hash_chain(tokens: list[int], block_size: int, extra: bytes, parent: BlockHash = ROOT,
               max_blocks: int | None = None) -> list[BlockHash]:
    """Hashes of every full block of `tokens` (at most max_blocks of them)."""
    n = len(tokens) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[BlockHash] = []
    for i in range(n):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out
