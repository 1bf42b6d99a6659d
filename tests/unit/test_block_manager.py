"""Block accounting with exact block ids."""
from __future__ import annotations

import pytest

from shared.engine.sequence import Sequence
from shared.kv.block_manager import BlockManager
from shared.sampling_params import SamplingParams


def seq(n: int) -> Sequence:
    return Sequence("r", 0, list(range(1, n + 1)), SamplingParams(temperature=0))


def test_allocate_append_free_exact_ids():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq(5), seq(4)
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1]                    # 5 tokens -> 2 blocks, one partly filled
    bm.allocate(b)
    assert b.block_table == [2]
    assert bm.num_free_blocks == 3
    bm.append(a, 8)                                   # still fits in 2 blocks
    assert a.block_table == [0, 1]
    bm.append(a, 9)
    assert a.block_table == [0, 1, 3]
    bm.free(a)                                        # freed tail first, so reuse order is predictable
    assert a.block_table == [] and bm.num_free_blocks == 5
    assert list(bm.free_ids) == [4, 5, 3, 1, 0]
    c = seq(9)
    bm.allocate(c)
    assert c.block_table == [4, 5, 3]
    assert bm.ref_counts == [0, 0, 1, 1, 1, 1]


def test_can_allocate_respects_capacity():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.can_allocate(seq(8)) and not bm.can_allocate(seq(9))
    s = seq(8)
    bm.allocate(s)
    assert not bm.can_append(s, 9)


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(3)
    bm.allocate(s)
    table = list(s.block_table)
    bm.free(s)
    counts, free = list(bm.ref_counts), dict(bm.free_ids)
    s.block_table = table
    with pytest.raises(RuntimeError):
        bm.free(s)
    assert list(bm.ref_counts) == counts and dict(bm.free_ids) == free      # refused before changing anything


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


# ---------------------------------------------------------------- prefix caching and copy-on-write
def committed(bm: BlockManager, s: Sequence) -> None:
    s.num_computed_tokens = len(s)
    bm.commit(s)


def test_prefix_hit_reuses_blocks_and_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(10)                                       # blocks [0, 1] full, [2] partial
    bm.allocate(a)
    committed(bm, a)
    assert a.block_table == [0, 1, 2] and len(bm.cached) == 2
    assert bm.drain_events() == (a.block_hashes[:2], [])
    b = seq(9)                                        # same first 8 tokens + 1
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.ref_counts[:3] == [2, 2, 1]
    c = seq(8)                                        # exactly two blocks: the last token is recomputed
    bm.allocate(c)
    assert c.block_table[:1] == [0] and c.num_computed_tokens == 4 and c.block_table[1] not in (0, 1)
    assert (bm.query_tokens, bm.hit_tokens) == (27, 12)


def test_different_salt_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(9)
    bm.allocate(a)
    committed(bm, a)
    b = Sequence("r", 0, list(range(1, 10)), SamplingParams(temperature=0), cache_extra=b"other tenant")
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)


def test_freed_cached_blocks_stay_reusable_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(13)                                       # 3 full blocks + 1 partial = all 4 blocks
    bm.allocate(a)
    committed(bm, a)
    h = list(a.block_hashes)
    bm.free(a)
    assert list(bm.free_ids) == [3, 2, 1, 0] and len(bm.cached) == 3    # tail of the chain first in LRU order
    b = seq(5)                                        # hits block 0; takes block 3 (uncached) for the rest
    bm.allocate(b)
    assert b.block_table == [0, 3] and bm.drain_events() == (h, [])
    d = Sequence("d", 0, [99] * 8, SamplingParams(temperature=0))      # needs 2 fresh blocks: evicts 2 then 1
    bm.allocate(d)
    assert d.block_table == [2, 1]
    assert bm.drain_events() == ([], [h[2], h[1]])
    assert list(bm.cached.values()) == [0]


def test_fork_shares_and_copy_on_write_copies_the_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(6)                                   # [0] full, [1] holds 2 tokens
    bm.allocate(parent)
    committed(bm, parent)
    child = Sequence("r", 1, list(range(1, 7)), SamplingParams(temperature=0))
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and bm.ref_counts[:2] == [2, 2]
    for s in (parent, child):
        s.token_ids.append(50 + s.index)              # each samples its own next token
    assert bm.can_append(parent, 7)
    bm.append(parent, 7)                              # writes position 6 into shared block 1: copy first
    assert parent.block_table == [0, 2] and bm.take_cache_work().copies == [(1, 2)]
    bm.append(child, 7)                               # block 1 is now the child's alone: no copy
    assert child.block_table == [0, 1] and bm.take_cache_work().copies == []
    assert bm.ref_counts[:3] == [2, 1, 1]
    bm.free(parent), bm.free(child)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8


def test_release_before_a_window_gives_back_whole_computed_blocks_once():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(14)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2, 3]
    a.num_computed_tokens = 14
    bm.release_before(a, 9)                              # positions 0-7 (blocks 0, 1) are behind every later row
    assert a.num_released_blocks == 2 and a.block_table[2:] == [2, 3] and bm.num_free_blocks == 6
    bm.release_before(a, 5)                              # never backwards, never twice
    assert bm.num_free_blocks == 6
    bm.release_before(a, 100)                            # only computed, whole blocks: 12 of 14 tokens
    assert a.num_released_blocks == 3 and bm.num_free_blocks == 7
    child = seq(14)
    bm.fork(a, child)                                    # the child shares only what the parent still holds
    assert child.num_released_blocks == 3 and bm.ref_counts[3] == 2
    bm.free(a)
    bm.free(child)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)
