"""The metrics of the target's expert-shard client (shared.shards.client): RPCs, their latency and bytes, stalls,
and the tokens routed to each expert, read from the clients' load tables at scrape time."""
from __future__ import annotations

import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily

RPCS = Counter("upesi_expert_rpcs_total", "Dispatch RPCs sent to expert shards", ["shard", "code"])
RPC_SECONDS = Histogram("upesi_expert_rpc_seconds", "Dispatch RPC latency, send to reply", ["shard"],
                        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
WIRE_BYTES = Counter("upesi_expert_wire_bytes_total", "Dispatch message bytes", ["direction"])
STALLS = Counter("upesi_expert_stalls_total", "Dispatch RPCs given up on before their deadline: the shard took far "
                 "longer than its measured time and had a replica, or did not answer its health check", ["shard"])


class ExpertTokens:
    """Exports `upesi_expert_tokens_total{layer, expert}` from the clients' load tables at scrape time, so the hot
    path only adds to a tensor. Dense layers count each FFN slice as an expert."""

    def __init__(self) -> None:
        self.clients: weakref.WeakSet = weakref.WeakSet()         # shared.shards.client.ExpertsClient

    def describe(self) -> list:
        return [CounterMetricFamily("upesi_expert_tokens", "Tokens routed to each expert (dense layers: FFN slices)",
                                    labels=["layer", "expert"])]

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = self.describe()[0]
        totals: dict[tuple[str, str], float] = {}
        for c in list(self.clients):
            for table in c.tokens.values():
                for layer, unit in table.nonzero().tolist():
                    key = (str(layer), str(unit))
                    totals[key] = totals.get(key, 0.0) + float(table[layer, unit])
        for key, value in sorted(totals.items()):
            fam.add_metric(list(key), value)
        yield fam


EXPERT_TOKENS = ExpertTokens()
REGISTRY.register(EXPERT_TOKENS)
