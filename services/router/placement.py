"""The router's choice of a target replica for a prompt, with the prefix registry consulted on its own threads.

A registry lookup is a blocking Redis call. It runs on a small pool of its own, never on asyncio's default pool
(which tokenises prompts), and never queued: while every registry thread still waits on a lookup (a frozen or slow
Redis), a request routes by load at once, and a lookup that does not answer within `wait_s` is abandoned the same way.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence

from shared.registry.base import BlockHash, PrefixRegistry, ReplicaId, ReplicaLoad, choose_replica

REGISTRY_WAIT_S = 0.1        # longest a routing decision waits on the prefix registry before routing by load
REGISTRY_THREADS = 2         # lookups in flight at most; more requests route by load meanwhile


class Placement:
    def __init__(self, registry: PrefixRegistry | None, wait_s: float = REGISTRY_WAIT_S,
                 threads: int = REGISTRY_THREADS) -> None:
        self.registry, self.wait_s, self.threads = registry, wait_s, threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: set[concurrent.futures.Future] = set()    # lookups submitted and not returned yet

    async def choose(self, chain: Sequence[BlockHash], replicas: Sequence[ReplicaId],
                     loads: Mapping[ReplicaId, ReplicaLoad], block_size: int) -> ReplicaId:
        """The replica with the least work for this prompt (shared.registry.base.choose_replica), by load alone
        when there is no registry, when every registry thread is busy, or when the lookup takes over wait_s."""
        self._running = {f for f in self._running if not f.done()}
        if self.registry is None or len(self._running) >= self.threads:
            return choose_replica(chain, replicas, loads, block_size)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="upesi-registry")
        lookup = self._pool.submit(choose_replica, chain, replicas, loads, block_size, registry=self.registry)
        self._running.add(lookup)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(lookup), self.wait_s)
        except asyncio.TimeoutError:
            return choose_replica(chain, replicas, loads, block_size)

    def close(self) -> None:
        """Stops the pool without waiting for a lookup still held by the registry."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
