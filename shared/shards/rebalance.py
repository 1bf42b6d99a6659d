"""Replicating hot experts (EPLB-style): from measured per-expert load, a new placement with extra replicas.

Pure: loads + placement -> placement. The target applies one with `ExpertsClient.apply_placement`, which has the
shards read the added units from the checkpoint (LoadExperts) before switching; no restart. A replicated expert's
tokens are spread evenly over its replicas, so a shard's expected load is the sum of load / replicas over its units.
Placement never changes outputs: replicas hold the same weights.

`Rebalancer` does this by itself while serving (`upesi target --rebalance-interval-s S`): every S seconds it looks at
the load measured since its last change, and when the busiest shard of some MoE layer carries more than `threshold`
times the mean, it replicates that layer's hottest experts onto the least loaded shards (EPLB-style, greedy), has the
shards load them (LoadExperts, off the engine thread) and then switches the placement in one reference swap, so
serving never waits for the weights to be read. Replicas are only ever added (at most one per shard per unit).

Shapes: L = layers, E = units per layer, N = shards.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch
from prometheus_client import Counter, Gauge

from shared.model.placement import Placement

if TYPE_CHECKING:
    from shared.shards.client import ExpertsClient

log = logging.getLogger("upesi.rebalance")
IMBALANCE = Gauge("upesi_expert_imbalance", "Expected tokens of the busiest expert shard over the mean, worst MoE "
                  "layer, over the load measured since the last placement change (1.0 = balanced)")
REBALANCES = Counter("upesi_expert_rebalances_total", "Placement changes made by the automatic rebalancer")


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
        new[layer] = order_replicas(load, table, n)
    return placement.with_layers(new)


def order_replicas(load: list[float], table: list[list[int]], num_shards: int) -> tuple[tuple[int, ...], ...]:
    """Puts first, among each replicated unit's shards, the one with the least load from first replicas.

    plan_dispatch sends token t of a step to replica t mod R, so a one-token step (batch-1 decode) uses only first
    replicas: ordering them this way balances that step too, not only the large ones."""
    first = [0.0] * num_shards
    for u, shards in enumerate(table):
        if len(shards) == 1:
            first[shards[0]] += load[u]
    out = [tuple(s) for s in table]
    for u in sorted((u for u, s in enumerate(table) if len(s) > 1), key=lambda u: (-load[u], u)):
        head = min(table[u], key=lambda s: (first[s], table[u].index(s)))
        first[head] += load[u]
        out[u] = (head, *(s for s in table[u] if s != head))
    return tuple(out)


class Rebalancer:
    """Replicates hot experts of a running ExpertsClient when its shards' load drifts apart (see the module doc).

    `check()` is one round (tests call it directly); `start()` runs it every `interval_s` on a daemon thread."""

    def __init__(self, client: ExpertsClient, interval_s: float, threshold: float = 1.25, extra: int = 2,
                 min_tokens: int = 256) -> None:
        if interval_s <= 0 or threshold < 1.0 or extra < 1 or min_tokens < 1:
            raise ValueError(f"rebalancer: interval_s > 0, threshold >= 1, extra >= 1 and min_tokens >= 1 needed, "
                             f"got {interval_s}, {threshold}, {extra}, {min_tokens}")
        self.client, self.interval_s, self.threshold = client, interval_s, threshold
        self.extra, self.min_tokens = extra, min_tokens
        self.layers = [i for i, dense in enumerate(client.dense_layers) if not dense]
        self._since = client.tokens[False].clone()                            # [L, E] load at the last change
        self.history: list[dict] = []                                        # one entry per placement change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def imbalances(self, loads: torch.Tensor | None = None) -> dict[int, float]:
        """Per MoE layer, busiest shard / mean under the current placement, of `loads` [L, E] (default: the load
        measured since the last change)."""
        window = self.client.tokens[False] - self._since if loads is None else loads
        p = self.client.placement
        return {layer: imbalance(window, p, layer) for layer in self.layers}

    def check(self) -> bool:
        """One round: True when it changed the placement."""
        now = self.client.tokens[False].clone()                              # [L, E]
        window = now - self._since
        if not self.layers or int(window[self.layers].sum()) < self.min_tokens:
            return False
        before = self.imbalances(window)
        worst = max(before.values())
        IMBALANCE.set(worst)
        hot = [layer for layer, x in before.items() if x > self.threshold]
        old = self.client.placement
        new = replicate_hot(window, old, self.extra, layers=hot) if hot else old
        if new.layers == old.layers:
            self._since = now                            # balanced (or nothing left to replicate): a fresh window
            return False
        loaded = self.client.apply_placement(new)
        after = {layer: imbalance(window, new, layer) for layer in self.layers}
        self._since = now
        REBALANCES.inc()
        self.history.append({"before": before, "after": after, "loaded": loaded})
        log.info("rebalanced %d layers: worst imbalance %.2f -> %.2f (expected on the last %d slots); loaded %s",
                 len(hot), worst, max(after.values()), int(window.sum()), loaded)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:                            # a shard down mid-load: try again next round
                log.exception("rebalancing failed; the placement is unchanged")

    def start(self) -> "Rebalancer":
        self._thread = threading.Thread(target=self._run, name="upesi-rebalancer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
