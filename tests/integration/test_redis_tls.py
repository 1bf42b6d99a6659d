"""The prefix registry and the KV block store over TLS (rediss://) on a real redis-server that listens on TLS only,
with a throw-away CA (shared.testing.pki): what the registry publishes a router finds, blocks written are read back,
and a client that does not trust the server's CA, or speaks plaintext, gets nothing (the registry unavailable, the
store's reads empty and writes refused) instead of a crash."""
from __future__ import annotations

import pytest

from shared.kv.hashing import BlockHash
from shared.kv.redis_tier import RedisTier
from shared.registry.base import RegistryUnavailable, ReplicaId
from shared.registry.factory import open_registry
from shared.registry.publisher import BlockPublisher
from shared.testing.pki import make_pki
from shared.testing.redis_server import RedisServer

A = ReplicaId("target-a:50052")


def chain(n: int) -> list[BlockHash]:
    return [BlockHash((0x9E3779B97F4A7C15 * (i + 1)) % (1 << 64)) for i in range(n)]


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("redis-tls")
    pki, other = make_pki(tmp, "ours"), make_pki(tmp, "other")
    server = RedisServer(tmp / "redis", tls=pki).start()
    yield server, pki, other
    server.stop()


def test_registry_round_trip_over_tls(tls_redis):
    server, _, _ = tls_redis
    assert server.url.startswith("rediss://")
    writer, reader = open_registry(server.url), open_registry(server.url)
    h = chain(5)
    pub = BlockPublisher(writer, A)
    pub.stored(h[:3])
    pub.start()
    try:
        assert pub.flush(5.0) and pub.registered
        assert reader.lookup(h) == {A: 3}
    finally:
        pub.stop()
        writer.close()
        reader.close()


def test_kv_blocks_round_trip_over_tls(tls_redis):
    server, _, _ = tls_redis
    tier = RedisTier(server.url, budget_bytes=1 << 20, ttl_s=60)
    try:
        blocks = [(BlockHash(1), b"a" * 100), (BlockHash(2), b"b" * 100)]
        assert tier.put("t", blocks)
        assert tier.get_leading("t", [BlockHash(1), BlockHash(2), BlockHash(3)]) == [b"a" * 100, b"b" * 100]
    finally:
        tier.close()


@pytest.mark.parametrize("client", ["untrusted CA", "plaintext"])
def test_clients_that_cannot_verify_or_do_not_speak_tls_get_nothing(tls_redis, client):
    server, pki, other = tls_redis
    url = (server.url.replace(str(pki["ca"]), str(other["ca"])) if client == "untrusted CA"
           else f"redis://127.0.0.1:{server.port}/0")
    reg = open_registry(url)
    tier = RedisTier(url, budget_bytes=1 << 20, ttl_s=60, timeout_s=1.0, read_timeout_s=1.0)
    try:
        with pytest.raises(RegistryUnavailable):
            reg.lookup(chain(2))
        assert tier.put("t", [(BlockHash(9), b"x" * 10)]) is False
        assert tier.get_leading("t", [BlockHash(1)]) == []
    finally:
        reg.close()
        tier.close()
