"""Replicating hot experts (EPLB-style): from measured per-expert load, a new placement with extra replicas.

Pure: loads + placement -> placement. The target applies one with `ExpertsClient.apply_placement`, which has the
shards read the added units from the checkpoint (LoadExperts) before switching; no restart. A replicated expert's
tokens are spread evenly over its replicas, so a shard's expected load is the sum of load / replicas over its units.
Placement never changes outputs: replicas hold the same weights.

Shapes: L = layers, E = units per layer, N = shards.
"""
from __future__ import annotations

import torch

from shared.model.placement import Placement


def shard_loads(load: list[float], table: list[list[int]], num_shards: int) -> list[float]:
    """Expected tokens per shard of one layer: each unit's load split evenly over its replicas."""
    out = [0.0] * num_shards
    for u, shards in enumerate(table):
        for s in shards:
            out[s] += load[u] / len(shards)
    return out


def imbalance(loads: torch.Tensor, placement: Placement, layer: int, dense: bool = False) -> float:
    """Busiest shard's load over the mean shard load for one layer (1.0 = perfectly balanced)."""
    table = [list(s) for s in placement.table(layer, dense)]
    per = shard_loads(loads[layer].double().tolist(), table, placement.num_shards)
    mean = sum(per) / len(per)
    return max(per) / mean if mean else 1.0


def replicate_hot(loads: torch.Tensor, placement: Placement, extra: int, layers: list[int] | None = None,
                  dense: bool = False) -> Placement:
    """Adds up to `extra` replicas per layer. loads [L, E]: tokens routed to each unit.

    Greedy, as EPLB does: take the unit with the highest load per replica, give it one more replica on the least
    loaded shard that lacks it; repeat. Layers with no measured load are left alone."""
    if extra < 0:
        raise ValueError(f"extra replicas must be >= 0, got {extra}")
    n = placement.num_shards
    new: dict[int, tuple[tuple[int, ...], ...]] = {}
    for layer in range(loads.shape[0]) if layers is None else layers:
        load = loads[layer].double().tolist()                                       # [E]
        if len(load) != placement.num_units(dense):
            raise ValueError(f"loads of layer {layer} cover {len(load)} units, the placement "
                             f"{placement.num_units(dense)}")
        if not any(load):
            continue
        table = [list(s) for s in placement.table(layer, dense)]
        for _ in range(extra):
            hot = [u for u in sorted(range(len(load)), key=lambda u: (-load[u] / len(table[u]), u))
                   if len(table[u]) < n and load[u] > 0]
            if not hot:
                break
            u = hot[0]
            per = shard_loads(load, table, n)
            table[u].append(min((s for s in range(n) if s not in table[u]), key=lambda s: (per[s], s)))
        new[layer] = tuple(tuple(s) for s in table)
    return placement.with_layers(new)
