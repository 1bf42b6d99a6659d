"""The host-memory tier: blocks the KV cache evicted, kept as tensors in this process under a byte budget (LRU).

It is a second level below the paged cache: a prompt whose prefix was evicted gets it back by a memory copy instead
of recomputing it. Nothing is serialised and nothing leaves the process.
"""
from __future__ import annotations

from collections import OrderedDict

from shared.kv.block_codec import BlockData
from shared.kv.hashing import BlockHash


class HostTier:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the host tier needs a positive budget, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[BlockHash, BlockData] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._blocks

    def get(self, h: BlockHash) -> BlockData | None:
        block = self._blocks.get(h)
        if block is not None:
            self._blocks.move_to_end(h)
        return block

    def put(self, h: BlockHash, block: BlockData) -> None:
        if block.nbytes > self.budget_bytes:
            return
        old = self._blocks.pop(h, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        self._blocks[h] = block
        self.used_bytes += block.nbytes
        while self.used_bytes > self.budget_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self.used_bytes -= dropped.nbytes
