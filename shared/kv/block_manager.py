"""Physical KV blocks: a free list, reference counts and per-sequence block tables.

    block table of a sequence (logical -> physical)      physical pool (num_blocks)
    [ 7 | 2 | 9 ]   16 + 16 + 5 tokens                   free: deque of ids, refcount 0
                                                          used: refcount >= 1
A sequence with L tokens in the cache owns ceil(L / block_size) blocks, so at most one block per
sequence is partly filled. Reference counts let several sequences share a block (prefix caching and
copy-on-write forks build on them).
"""
from __future__ import annotations

from collections import deque
from typing import NewType

from shared.engine.sequence import Sequence

BlockId = NewType("BlockId", int)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------- allocate: room for every token the sequence has now
    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(len(seq)) - len(seq.block_table) <= len(self.free_ids)

    def allocate(self, seq: Sequence) -> None:
        for _ in range(self.blocks_for(len(seq)) - len(seq.block_table)):
            seq.block_table.append(self._take())

    # -------- append: room for `n` more tokens after the ones in the table
    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self.free_ids)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Makes the table hold `num_tokens` tokens in all."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            if self.ref_counts[block] == 0:
                self.free_ids.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _take(self) -> BlockId:
        block = self.free_ids.popleft()
        self.ref_counts[block] = 1
        return block
