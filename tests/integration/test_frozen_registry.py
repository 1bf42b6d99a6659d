"""The router's placement with a real prefix registry (redis-server): it follows the registry while Redis answers,
and while Redis is frozen (SIGSTOP) it routes by load at once instead of waiting out the registry's timeouts."""
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
        self.lock = threading.Lock()

    def lookup(self, chain):
        with self.lock:
            self.started += 1
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

    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        # by load alone (the first of equals), while the lookup still waits on Redis
        assert asyncio.run(frozen()) == ("a:1", 2, 1)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    for _ in range(100):                                              # the abandoned lookup ends by itself
        if counted.returned == 2:
            break
        time.sleep(0.05)
    assert counted.returned == 2
    registry.close()
