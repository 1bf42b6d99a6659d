"""The router's placement with a real prefix registry (redis-server): it follows the registry while Redis answers,
and while Redis is frozen (SIGSTOP) it routes by load at once instead of waiting out the registry's timeouts, with
the lookups on the registry's own threads, never more of them than those threads."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

from services.router.config import RouterConfig
from services.router.frontend import Frontend
from services.router.target_client import TargetInfo
from shared.kv.hashing import cache_extra, hash_chain
from shared.model_files import default_model_path
from shared.registry.base import ReplicaId, ReplicaLoad
from shared.registry.factory import open_registry
from shared.tokenizer import Tokenizer

BS = 16


class CountedLookups:
    """The registry, with its lookups counted as they start and as they return."""

    def __init__(self, registry) -> None:
        self.registry, self.started, self.returned = registry, 0, 0
        self.threads: set[str] = set()                                # the pools the lookups ran on
        self.lock = threading.Lock()

    def lookup(self, chain):
        with self.lock:
            self.started += 1
            self.threads.add(threading.current_thread().name.split("_")[0])
        try:
            return self.registry.lookup(chain)
        finally:
            with self.lock:
                self.returned += 1


def test_routing_follows_the_registry_and_does_not_wait_on_a_frozen_one(redis_server):
    info = TargetInfo("m", 1024, 49152, [0], BS)
    targets = [SimpleNamespace(address=a, up=True) for a in ("a:1", "b:2")]
    registry = open_registry(redis_server.url)
    counted = CountedLookups(registry)
    front = Frontend(RouterConfig(), Tokenizer(default_model_path()), targets, info, counted)
    ids = list(range(100, 100 + 8 * BS))
    chain = hash_chain(ids, BS, cache_extra(info.model, ""))
    registry.register(ReplicaId("b:2"), chain, ReplicaLoad())      # the second replica holds the whole prompt

    assert asyncio.run(front.choose_target(ids, "")).address == "b:2"
    assert (counted.started, counted.returned) == (1, 1)

    async def frozen() -> tuple[str, int, int]:
        chosen = await front.choose_target(ids, "")                   # read before the loop's executor shuts down
        return chosen.address, counted.started, counted.returned

    async def flood() -> tuple[list[str], int, str]:
        # 20 requests at once, then a tokenisation-sized job on the default pool: none of it waits on Redis
        chosen = await asyncio.gather(*(front.choose_target(ids, "") for _ in range(20)))
        return [t.address for t in chosen], counted.started, await asyncio.to_thread(lambda: "free")

    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        # by load alone (the first of equals), while the lookup still waits on Redis
        assert asyncio.run(frozen()) == ("a:1", 2, 1)
        # one more lookup takes the second registry thread; the other 19 route by load without a lookup
        assert asyncio.run(flood()) == (["a:1"] * 20, 3, "free")
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    for _ in range(100):                                              # the abandoned lookups end by themselves
        if counted.returned == 3:
            break
        time.sleep(0.05)
    assert counted.returned == 3
    assert counted.threads == {"upesi-registry"}
    for _ in range(60):                        # Redis answers again (after the registry's pause on a failed call)
        if asyncio.run(front.choose_target(ids, "")).address == "b:2":
            break
        time.sleep(0.05)
    assert asyncio.run(front.choose_target(ids, "")).address == "b:2"
    front.placement.close()
    registry.close()
