"""Replica order from measured load (shared.shards.rebalance.order_replicas): plan_dispatch sends token t of a step
to replica t mod R, so the first replicas must balance by themselves for one-token steps (batch-1 decode)."""
from __future__ import annotations

import torch

from shared.model.placement import Placement, plan_dispatch, replica_table
from shared.shards.rebalance import imbalance, replicate_hot


def _shard_slots(placement: Placement, ids: torch.Tensor) -> list[int]:
    plan = plan_dispatch(ids, replica_table(placement.table(0, dense=False)))
    return [plan[s].slots.numel() if s in plan else 0 for s in range(placement.num_shards)]


def test_two_hot_experts_on_one_shard_split_over_both_even_for_one_token():
    p = Placement(2, 8)                                             # experts 0-3 on shard 0, 4-7 on shard 1
    loads = torch.zeros(1, 8)
    loads[0, :2] = 100                                              # every token picks experts 0 and 1
    q = replicate_hot(loads, p, extra=2)
    assert q.table(0, dense=False)[:2] == ((0, 1), (1, 0))          # replicated, first replicas on different shards
    assert imbalance(loads, p, 0) == 2.0 and imbalance(loads, q, 0) == 1.0
    one = torch.tensor([[0, 1]])                                    # a one-token step
    assert _shard_slots(p, one) == [2, 0] and _shard_slots(q, one) == [1, 1]
    many = torch.tensor([[0, 1]] * 5)
    assert _shard_slots(q, many) == [5, 5]


def test_first_replicas_go_where_unreplicated_load_is_lightest():
    p = Placement(3, 6, {0: ((0,), (0,), (1,), (1,), (2,), (2,))})
    loads = torch.tensor([[90.0, 10, 30, 30, 2, 2]])
    q = replicate_hot(loads, p, extra=1)
    assert q.table(0, dense=False)[0] == (2, 0)                     # shard 2 carries least without the hot expert
