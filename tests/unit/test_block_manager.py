"""Block accounting with exact block ids."""
from __future__ import annotations

import pytest

from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Sequence
from shared.kv.block_manager import BlockManager


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
    s.block_table = table
    with pytest.raises(RuntimeError):
        bm.free(s)
    assert min(bm.ref_counts) >= -1


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
