"""Least privilege on Redis (docs/security.md): a real redis-server with the three ACL users of
shared.registry.redis_roles, one per role. The targets' registry user publishes blocks, the router's read-only user
routes by them, the targets' block-store user keeps KV blocks; each role works with its own credentials and is
refused (NOPERM) everything else: the router writes nothing and reads no KV block, the block store's user cannot
touch the registry nor the registry's the blocks."""
from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
import redis

from shared.kv.redis_tier import RedisTier
from shared.registry.base import BlockHash, ReplicaId, ReplicaLoad
from shared.registry.publisher import BlockPublisher
from shared.registry.redis_backend import RedisRegistry
from shared.registry.redis_roles import user_line
from shared.testing.redis_server import RedisServer

A = ReplicaId("target-a:50052")
PW = {role: secrets.token_hex(16) for role in ("admin", "router", "registry", "kv")}
USERS = [user_line(f"upesi-{role}", PW[role]) for role in ("router", "registry", "kv")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis-acl"), password=PW["admin"], users=USERS).start()
    try:
        yield s
    finally:
        s.stop()


def url(server: RedisServer, role: str, db: int = 0) -> str:
    return f"redis://upesi-{role}:{PW[role]}@127.0.0.1:{server.port}/{db}"


def chain(n: int) -> list[BlockHash]:
    return [BlockHash(0x9E3779B97F4A7C15 * (i + 1) % (1 << 64)) for i in range(n)]


def test_each_role_works_with_its_own_user(server: RedisServer) -> None:
    writer = RedisRegistry(url(server, "registry"), lease_s=30.0)
    reader = RedisRegistry(url(server, "router"), lease_s=30.0)
    pub = BlockPublisher(writer, A, flush_interval_s=0.01)
    pub.start()
    h = chain(5)
    pub.stored(h)
    pub.set_load(queued=0, running=2)
    assert pub.flush(5.0) and pub.registered
    assert reader.lookup(h) == {A: 5}                            # the router routes by what the target published
    writer.heartbeat(A, ReplicaLoad(0, 2))
    assert reader.loads() == {A: ReplicaLoad(0, 2)}
    store = RedisTier(url(server, "kv", db=1), budget_bytes=1 << 20, ttl_s=60)
    assert store.put("tag0", [(h[0], b"k" * 100), (h[1], b"v" * 100)])
    assert store.get_leading("tag0", h[:3]) == [b"k" * 100, b"v" * 100]
    pub.stop()
    for c in (writer, reader):
        c.close()
    store.close()


def test_the_router_writes_nothing_and_reads_no_block(server: RedisServer) -> None:
    router = redis.Redis.from_url(url(server, "router"))
    router.smembers("upesi:reg:replicas")                        # reading the registry is allowed
    for attempt in (lambda: router.sadd("upesi:reg:replicas", "evil:1"), lambda: router.delete("upesi:reg:replicas"),
                    lambda: router.set("upesi:reg:lease:evil", "x"), lambda: router.get("upesi:kv:tag0:00"),
                    lambda: router.eval("return 1", 0), lambda: router.flushall(), lambda: router.config_get("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    router.close()


def test_the_registry_and_the_block_store_stay_apart(server: RedisServer) -> None:
    kv = redis.Redis.from_url(url(server, "kv", db=1))
    registry = redis.Redis.from_url(url(server, "registry"))
    kv.set("upesi:kv:tag1:0001", b"block")
    for attempt in (lambda: kv.sadd("upesi:reg:replicas", "evil:1"), lambda: kv.smembers("upesi:reg:replicas"),
                    lambda: registry.get("upesi:kv:tag1:0001"), lambda: registry.set("upesi:kv:tag1:0001", b"forged"),
                    lambda: registry.flushdb(), lambda: kv.keys("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert kv.get("upesi:kv:tag1:0001") == b"block"
    for c in (kv, registry):
        c.close()


def test_the_router_routes_on_when_it_may_not_prune_an_expired_replica(server: RedisServer) -> None:
    """A replica whose lease ran out is pruned from the replica set by whoever reads it; the router's user may not
    (NOPERM on the script), which costs nothing: its lookup still leaves the expired replica out."""
    writer = RedisRegistry(url(server, "registry"), lease_s=0.3)
    reader = RedisRegistry(url(server, "router"), lease_s=0.3)
    b = ReplicaId("target-b:50052")
    writer.register(b, chain(3), ReplicaLoad())
    assert reader.lookup(chain(3)) == {b: 3}
    time.sleep(0.5)                                              # the lease expires
    assert reader.lookup(chain(3)) == {}
    assert b.encode() in redis.Redis.from_url(url(server, "registry")).smembers("upesi:reg:replicas")   # not pruned
    for c in (writer, reader):
        c.close()
