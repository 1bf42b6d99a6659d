"""Prefix-block registry on a real redis-server (started per test on a free port): round trips, batching measured in
Redis round trips, lease expiry, first-miss stop, and routing through a Redis outage and back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared.registry.base import BlockHash, RegistryUnavailable, ReplicaId, ReplicaLoad, choose_replica
from shared.registry.factory import open_registry
from shared.registry.publisher import BlockPublisher
from shared.registry.redis_backend import RedisRegistry
from shared.testing.redis_server import RedisServer

A, B = ReplicaId("target-a:50052"), ReplicaId("target-b:50052")
IDLE = ReplicaLoad()


def chain(n: int, start: int = 1) -> list[BlockHash]:
    return [BlockHash((0x9E3779B97F4A7C15 * (start + i)) % (1 << 64)) for i in range(n)]  # full 64-bit values


def wait_until(predicate: Callable[[], bool], timeout_s: float = 8.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def registries(redis_url: str) -> Iterator[Callable[..., RedisRegistry]]:
    """Opens `RedisRegistry` clients on the test's server and closes them afterwards."""
    opened: list[RedisRegistry] = []

    def make(**kw: Any) -> RedisRegistry:
        reg = RedisRegistry(redis_url, **kw)
        opened.append(reg)
        return reg

    yield make
    for reg in opened:
        reg.close()


def test_publish_lookup_round_trip(redis_url: str) -> None:
    writer, reader = open_registry(redis_url), open_registry(redis_url)  # a target's and a router's connection
    h = chain(6)
    pub = BlockPublisher(writer, A)
    pub.stored(h[:4])
    pub.set_load(queued=2, running=3)
    pub.start()
    assert pub.flush(5.0) and pub.registered
    pub.removed(h[3:4])
    pub.stored(h[4:5])  # not a prefix: h[3] is gone
    assert pub.flush(5.0)
    assert reader.lookup(h) == {A: 3}
    assert reader.lookup(h[4:]) == {A: 1}
    assert reader.lookup(chain(3, start=100)) == {A: 0}
    pub.set_load(queued=0, running=1)
    writer.heartbeat(A, ReplicaLoad(0, 1))
    assert reader.loads() == {A: ReplicaLoad(0, 1)}
    pub.stop()  # withdraw: gone at once
    assert reader.lookup(h) == {} and reader.loads() == {}
    writer.close()
    reader.close()


def test_many_stored_calls_make_few_round_trips(registries: Callable[..., RedisRegistry]) -> None:
    reg = registries(lease_s=30.0)  # heartbeats every 10 s: none during the test
    pub = BlockPublisher(reg, A, flush_interval_s=60.0, max_batch=100_000)
    pub.start()
    assert pub.flush(5.0)
    h = chain(1000)
    before = reg.round_trips
    for x in h:
        pub.stored([x])
    assert pub.flush(5.0)
    assert reg.round_trips - before == 1  # 1000 stored() calls, one MULTI/EXEC
    assert registries().lookup(h) == {A: 1000}

    pub2 = BlockPublisher(reg, B, flush_interval_s=60.0, max_batch=100)
    pub2.start()
    assert pub2.flush(5.0)
    before = reg.round_trips
    for x in h:
        pub2.stored([x])
    assert pub2.flush(5.0)
    assert 1 <= reg.round_trips - before <= 11  # at most one flush per 100 hashes, plus the final one
    assert registries().lookup(h) == {A: 1000, B: 1000}
    pub.stop()
    pub2.stop()


def test_lookup_stops_at_first_miss(registries: Callable[..., RedisRegistry]) -> None:
    writer, reader = registries(), registries(first_chunk=2)
    h = chain(100)
    writer.register(A, h[:3] + h[4:], IDLE)  # everything but block 3
    writer.register(B, h[:1], IDLE)
    before = reader.round_trips
    assert reader.lookup(h) == {A: 3, B: 1}
    # SMEMBERS; leases + blocks 0-1 (both match 0, only A matches 1); blocks 2-5 for A (miss at 3): then stop,
    # where a full scan of 100 blocks would have taken chunks of 2, 4, ..., 64.
    assert reader.round_trips - before == 3
    before = reader.round_trips
    assert reader.lookup(chain(100, start=1000)) == {A: 0, B: 0}  # first block held by nobody: one chunk only
    assert reader.round_trips - before == 2


def test_entries_expire_when_heartbeats_stop(registries: Callable[..., RedisRegistry]) -> None:
    reader = registries()
    h = chain(4)
    alive = BlockPublisher(registries(lease_s=1.0), A, flush_interval_s=0.01)
    dying = BlockPublisher(registries(lease_s=1.0), B, flush_interval_s=0.01)
    for pub in (alive, dying):
        pub.stored(h)
        pub.start()
        assert pub.flush(5.0)
    assert reader.lookup(h) == {A: 4, B: 4}
    dying.stop(withdraw=False)  # a crash: no goodbye, the lease just runs out
    assert wait_until(lambda: B not in reader.lookup(h))
    assert reader.lookup(h) == {A: 4}  # A, heartbeating every lease/3, stays
    assert set(reader.loads()) == {A}
    alive.stop()


def test_routing_survives_redis_outage_and_index_refills(
    redis_server: RedisServer, registries: Callable[..., RedisRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    target = registries(lease_s=1.0, retry_after_s=0.2)
    router = registries(retry_after_s=0.2)
    h = chain(32)
    pub = BlockPublisher(target, B, flush_interval_s=0.01)
    pub.stored(h[:20])
    pub.start()
    assert pub.flush(5.0)
    loads = {A: IDLE, B: ReplicaLoad(0, 1)}
    assert choose_replica(h, [A, B], loads, 16, registry=router) == B  # 320 cached tokens beat one request (256)

    caplog.set_level(logging.WARNING, logger="shared.registry.redis_backend")
    redis_server.stop()
    for _ in range(5):  # no exception, load-only choice
        assert choose_replica(h, [A, B], loads, 16, registry=router) == A
        time.sleep(0.05)
    with pytest.raises(RegistryUnavailable):
        router.lookup(h)
    pub.stored(h[20:28])  # the engine goes on; these deltas are dropped, the mirror keeps them
    assert pub.flush(5.0)
    assert wait_until(lambda: not pub.registered)

    redis_server.restart()  # empty, same port
    assert wait_until(lambda: router_lookup(router, h) == {B: 28})  # re-registered with the full mirror
    assert pub.registrations >= 2
    # Dozens of failed calls, one warning per client (the target's and the router's).
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 2
    assert choose_replica(h, [A, B], loads, 16, registry=router) == B
    pub.stop()


def router_lookup(reg: RedisRegistry, h: list[BlockHash]) -> dict[ReplicaId, int] | None:
    try:
        return reg.lookup(h)
    except RegistryUnavailable:
        return None


def test_error_replies_and_foreign_entries_route_by_load(
    redis_url: str, registries: Callable[..., RedisRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    """Answers that are not a lost connection: a member that is not UTF-8 is skipped; a key of the wrong type
    (WRONGTYPE) makes the index unusable, so routing falls back to load, logged once, and recovers after."""
    import redis

    raw = redis.Redis.from_url(redis_url)
    target, router = registries(), registries(retry_after_s=0.05)
    h = chain(8)
    pub = BlockPublisher(target, B, flush_interval_s=0.01)
    pub.stored(h[:6])
    pub.start()
    assert pub.flush(5.0)
    raw.sadd("upesi:reg:replicas", b"\xff\xfe not a replica")
    assert router.lookup(h) == {B: 6}
    loads = {A: IDLE, B: IDLE}                              # equal loads: the cached prefix decides (B), or order (A)
    assert choose_replica(h, [A, B], loads, 16, registry=router) == B

    caplog.set_level(logging.WARNING, logger="shared.registry.redis_backend")
    raw.rename("upesi:reg:replicas", "saved")
    raw.set("upesi:reg:replicas", "a string, not a set")
    with pytest.raises(RegistryUnavailable, match="failing"):
        router.lookup(h)
    time.sleep(0.06)
    for _ in range(3):
        assert choose_replica(h, [A, B], loads, 16, registry=router) == A      # by load, no exception
        time.sleep(0.06)
    assert sum("WRONGTYPE" in r.getMessage() for r in caplog.records) == 1
    raw.delete("upesi:reg:replicas")
    raw.rename("saved", "upesi:reg:replicas")
    time.sleep(0.06)
    assert router.lookup(h) == {B: 6}
    pub.stop()
    raw.close()


def test_a_read_only_user_routes(redis_url: str, registries: Callable[..., RedisRegistry]) -> None:
    """A router whose Redis user may only read still routes: pruning a replica whose lease expired is left to the
    targets' side (NOPERM is not an outage)."""
    import redis

    raw = redis.Redis.from_url(redis_url)
    raw.execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~*", "+@read", "+@connection")
    target = registries(lease_s=0.5)
    pub = BlockPublisher(target, B, flush_interval_s=0.01)
    h = chain(4)
    pub.stored(h)
    pub.start()
    assert pub.flush(5.0)
    raw.sadd("upesi:reg:replicas", str(A))                 # listed, but its lease is gone: a reader would prune it
    url = redis_url.replace("redis://", "redis://reader:reader-pw@")
    reader = RedisRegistry(url)
    try:
        assert reader.lookup(h) == {B: 4}
        assert raw.sismember("upesi:reg:replicas", str(A))   # the reader could not prune it, and did not fail
    finally:
        reader.close()
        pub.stop()
        raw.close()
