"""Physical KV blocks: free list, reference counts, block tables, prefix caching and copy-on-write.

    block table of a sequence (logical -> physical)      physical pool (num_blocks)
    [ 7 | 2 | 9 ]   16 + 16 + 5 tokens                   ref_counts[b]: sequences using block b
      h7  h2  -    full blocks carry a hash              free: LRU order, ref 0 (may still be cached)
                                                          cached: hash -> block, reusable until evicted

- A sequence with L tokens owns ceil(L / block_size) blocks: at most one is partly filled.
- A full block whose tokens are computed is committed: hashed (shared.kv.hashing) and offered for reuse. A new
  sequence whose prompt starts with the same blocks takes them (refcount + 1) instead of recomputing them.
- Freed blocks go to the back of the LRU list, a chain's tail first, so tails are evicted before heads. Taking a
  cached block from the free list for new data evicts it (its hash goes to `removed`).
- fork() shares every block of a parent; a sequence about to write into a block with refcount > 1 gets a private
  copy first (copy-on-write): the copy is queued for the model runner to perform (`take_cache_work`).
- With a block store (`source`, shared.kv.block_store): a new sequence whose cached prefix ends early asks the store
  for the blocks that follow; those it gets are taken from the pool, committed at once, and queued for the model
  runner to fill. With `track_evictions`, evicted blocks are queued for the engine to copy out before the pass
  overwrites them (`take_cache_work`); with `track_commits` / `track_reuse`, newly committed and matched cached
  blocks, to copy out after it (`take_store_work`). Stored and removed hashes go to the prefix registry
  (`drain_events`).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

from shared.kv.hashing import BlockHash, hash_chain

BlockId = NewType("BlockId", int)


class Sequence(Protocol):
    """What the block manager reads and keeps on a sequence (shared.engine.sequence.Sequence is one)."""
    token_ids: list[int]
    block_table: list[int]                 # block ids holding the sequence's tokens, in order
    block_hashes: list[int]                # hashes of its full blocks
    num_computed_tokens: int
    num_cached_tokens: int
    num_committed_blocks: int
    cache_extra: bytes

    @property
    def num_output_tokens(self) -> int: ...


class BlockSource(Protocol):
    """Where blocks missing from the cache may be found (shared.kv.block_store.KVBlockStore is one)."""

    def lookup(self, hashes: Seq[BlockHash]) -> list[Any]:
        """The contents of the longest run of `hashes` from the first that it holds."""
        ...


@dataclass(slots=True)
class CacheWork:
    """The block manager's requests to the model runner, done before the next forward pass."""
    evictions: list[tuple[BlockId, BlockHash]] = field(default_factory=list)   # cached blocks about to be overwritten
    copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)        # copy-on-write: (src, dst)
    imports: list[tuple[BlockId, Any]] = field(default_factory=list)           # (block, contents from the source)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, BlockId] = {}
        self.free_ids: OrderedDict[BlockId, None] = OrderedDict((BlockId(i), None) for i in range(num_blocks))
        self._work = CacheWork()                                    # for the model runner, before the pass
        self._stored: list[BlockHash] = []                          # events for the prefix registry
        self._removed: list[BlockHash] = []
        self.query_tokens = 0                                       # prompt tokens looked up in the cache
        self.hit_tokens = 0                                         # ... and found there (or in the store)
        self.source: BlockSource | None = None
        self.track_evictions = self.track_commits = self.track_reuse = False
        self._commits: list[tuple[BlockId, BlockHash]] = []         # blocks newly committed
        self._reuses: list[tuple[BlockId, BlockHash]] = []          # cached blocks a new sequence matched

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------- allocate: room for every token the sequence has now, reusing cached prefix blocks
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of the sequence's first num_blocks full blocks (computed once, extended as it grows)."""
        have = seq.block_hashes
        if len(have) < num_blocks:
            bs = self.block_size
            parent = have[-1] if have else BlockHash(0)
            have.extend(hash_chain(seq.token_ids[len(have) * bs:num_blocks * bs], bs, seq.cache_extra, parent))
        return have[:num_blocks]

    def _match(self, seq: Sequence) -> list[BlockId]:
        """Cached blocks for the longest prefix; the last token is always left to compute (it yields logits)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits = []
        for h in self._hashes(seq, (len(seq) - 1) // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match(seq)
        reusable_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        need = self.blocks_for(len(seq)) - len(seq.block_table) - len(hits)
        return need <= len(self.free_ids) - reusable_free

    def allocate(self, seq: Sequence) -> None:
        if not seq.block_table:                      # a new (or preempted) sequence: reuse its cached prefix
            hits = self._match(seq)
            for block in hits:
                if self.ref_counts[block] == 0:
                    del self.free_ids[block]
                self.ref_counts[block] += 1
            if self.track_reuse:
                self._reuses.extend((block, self.block_hash[block]) for block in hits)
            seq.block_table = list(hits)
            known = len(hits) + self._import(seq, len(hits))
            seq.num_committed_blocks = known
            seq.num_computed_tokens = known * self.block_size
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.query_tokens += len(seq)
                self.hit_tokens += seq.num_computed_tokens
        for _ in range(self.blocks_for(len(seq)) - len(seq.block_table)):
            seq.block_table.append(self._take())

    def _import(self, seq: Sequence, start: int) -> int:
        """Appends the blocks after the first `start` that the source holds; returns how many."""
        if self.source is None or not self.enable_prefix_caching:
            return 0
        wanted = self._hashes(seq, (len(seq) - 1) // self.block_size)[start:]
        found = self.source.lookup(wanted) if wanted else []
        for h, contents in zip(wanted, found):
            block = self.cached.get(h)
            if block is not None:                    # cached here after all (its predecessor was evicted first)
                if self.ref_counts[block] == 0:
                    del self.free_ids[block]
                self.ref_counts[block] += 1
            else:
                block = self._take()
                self.block_hash[block] = h
                self.cached[h] = block
                self._stored.append(h)
                self._work.imports.append((block, contents))
            seq.block_table.append(block)
        return len(found)

    # -------- append: room for `num_tokens` tokens in all, copying shared blocks that will be written
    def _writes(self, seq: Sequence, num_tokens: int) -> range:
        """Logical blocks the next step writes into (positions num_computed .. num_tokens - 1)."""
        return range(seq.num_computed_tokens // self.block_size, self.blocks_for(num_tokens))

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        table = seq.block_table
        copies = sum(1 for i in self._writes(seq, num_tokens) if i < len(table) and self.ref_counts[table[i]] > 1)
        return self.blocks_for(num_tokens) - len(table) + copies <= len(self.free_ids)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        table = seq.block_table
        for i in self._writes(seq, num_tokens):
            if i < len(table) and self.ref_counts[table[i]] > 1:       # copy-on-write
                src, dst = table[i], self._take()
                self.ref_counts[src] -= 1
                self._work.copies.append((src, dst))
                table[i] = dst
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            table.append(self._take())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (and its computed state)."""
        for block in parent.block_table[parent.num_released_blocks:]:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_released_blocks = parent.num_released_blocks
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_committed_blocks = parent.num_committed_blocks
        child.num_cached_tokens = parent.num_cached_tokens

    def commit(self, seq: Sequence) -> None:
        """Offers the sequence's newly computed full blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                self._stored.append(h)
                if self.track_commits:
                    self._commits.append((block, h))
        seq.num_committed_blocks = full

    def trim(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Returns the blocks past the first `num_tokens` (default: all the sequence's tokens), after a speculative
        rollback. Blocks past the computed tokens were never committed."""
        keep = self.blocks_for(len(seq) if num_tokens is None else num_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids[block] = None
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Gives back the sequence's blocks; a block it does not hold (a second free) raises before any changes."""
        held = seq.block_table[seq.num_released_blocks:]
        for block, times in Counter(held).items():
            if self.ref_counts[block] < times:
                raise RuntimeError(f"block {block} freed more often than taken")
        for block in reversed(held):                                      # tail first: evicted first
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids[block] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_committed_blocks = seq.num_released_blocks = 0

    def release_before(self, seq: Sequence, position: int) -> None:
        """A sliding window: gives back the computed blocks wholly before `position`, the first position any later
        row of the sequence attends. Their table entries stay, as block 0, so that positions keep their index; the
        attention kernels read nothing before a row's window (a committed block stays in the prefix cache until
        its slot is taken)."""
        upto = min(max(position, 0) // self.block_size, seq.num_computed_tokens // self.block_size)
        for i in range(seq.num_released_blocks, upto):
            block = seq.block_table[i]
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids[block] = None
            seq.block_table[i] = BlockId(0)
        seq.num_released_blocks = max(seq.num_released_blocks, upto)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """The hashes stored and removed since the last call, for the prefix registry."""
        stored, removed, self._stored, self._removed = self._stored, self._removed, [], []
        return stored, removed

    def take_cache_work(self) -> CacheWork:
        """What the model runner must do to the cache before the next forward pass writes it."""
        work, self._work = self._work, CacheWork()
        return work

    def take_store_work(self) -> tuple[list[tuple[BlockId, BlockHash]], list[tuple[BlockId, BlockHash]]]:
        """(matched cached blocks, newly committed blocks) since the last call, for the block store."""
        reuses, commits, self._reuses, self._commits = self._reuses, self._commits, [], []
        return reuses, commits

    def _take(self) -> BlockId:
        block, _ = self.free_ids.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:                                              # evict from the prefix cache
            del self.cached[h]
            self._removed.append(h)
            if self.track_evictions:
                self._work.evictions.append((block, h))
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block
