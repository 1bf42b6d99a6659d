"""Prefix-block registry, in-process backend: exact lookups, leases on a fake clock, publisher batching, routing."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from shared.registry.base import (
    BlockHash,
    PrefixRegistry,
    RegistryUnavailable,
    ReplicaId,
    ReplicaLoad,
    as_block_hash,
    choose_replica,
)
from shared.registry.factory import open_registry
from shared.registry.memory import MemoryRegistry
from shared.registry.publisher import BlockPublisher

A, B, C = ReplicaId("target-a"), ReplicaId("target-b"), ReplicaId("target-c")
IDLE = ReplicaLoad()


def hashes(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingRegistry(MemoryRegistry):
    """Counts publish calls: each would be one round trip to a remote store."""

    def __init__(self, lease_s: float = 10.0) -> None:
        super().__init__(lease_s)
        self.publishes = 0

    def publish(self, replica: ReplicaId, stored: Sequence[BlockHash] = (), removed: Sequence[BlockHash] = ()) -> None:
        self.publishes += 1
        super().publish(replica, stored, removed)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_lookup_counts_leading_blocks_and_stops_at_first_miss() -> None:
    reg = MemoryRegistry()
    reg.register(A, hashes(1, 2, 4, 5), IDLE)  # holds blocks 0, 1, 3, 4 of the chain, not block 2
    reg.register(B, hashes(1), IDLE)
    reg.register(C, [], IDLE)
    assert reg.lookup(hashes(1, 2, 3, 4, 5)) == {A: 2, B: 1, C: 0}
    assert reg.lookup(hashes(9, 1, 2)) == {A: 0, B: 0, C: 0}
    assert reg.lookup([]) == {A: 0, B: 0, C: 0}


def test_publish_applies_batches_and_register_replaces_the_set() -> None:
    reg = MemoryRegistry()
    reg.register(A, hashes(1, 2), IDLE)
    reg.publish(A, stored=hashes(3), removed=hashes(1))
    assert reg.lookup(hashes(2, 3)) == {A: 2}
    assert reg.lookup(hashes(1)) == {A: 0}
    reg.register(A, hashes(7), IDLE)  # a re-registration is the whole truth
    assert reg.lookup(hashes(2)) == {A: 0}
    assert reg.lookup(hashes(7)) == {A: 1}
    reg.withdraw(A)
    assert reg.lookup(hashes(7)) == {}


def test_lease_expires_without_heartbeats() -> None:
    clock = FakeClock()
    reg = MemoryRegistry(lease_s=1.0, clock=clock)
    reg.register(A, hashes(1, 2), ReplicaLoad(queued=1, running=2))
    reg.register(B, hashes(1), IDLE)
    clock.now += 0.9
    assert reg.heartbeat(A, ReplicaLoad(queued=0, running=3))  # A keeps its lease, B does not
    assert reg.loads() == {A: ReplicaLoad(0, 3), B: IDLE}
    clock.now += 0.2
    assert reg.lookup(hashes(1, 2)) == {A: 2}
    assert reg.loads() == {A: ReplicaLoad(0, 3)}
    assert not reg.heartbeat(B, IDLE)  # lost: the writer must register again
    reg.publish(B, stored=hashes(1))  # a batch without a lease is dropped, not resurrected
    assert B not in reg.lookup(hashes(1))


def test_choose_replica_weighs_cached_prefix_against_load() -> None:
    reg = MemoryRegistry()
    chain = hashes(*range(1, 33))  # 32 blocks of 16 = 512 prompt tokens
    reg.register(A, chain[:20], IDLE)  # saves 320 tokens of prefill
    reg.register(B, chain[:2], IDLE)
    replicas = [A, B]
    assert choose_replica(chain, replicas, {A: IDLE, B: IDLE}, 16, registry=reg) == A
    # One request of load costs 256 tokens: 320 saved still beats one more request ...
    assert choose_replica(chain, replicas, {A: ReplicaLoad(1, 0), B: IDLE}, 16, registry=reg) == A
    # ... but not two (512 > 320 - 32).
    assert choose_replica(chain, replicas, {A: ReplicaLoad(1, 1), B: IDLE}, 16, registry=reg) == B
    # No registry: load alone, ties to the earlier replica; unknown loads count as idle.
    assert choose_replica(chain, replicas, {A: ReplicaLoad(0, 1)}, 16) == B
    assert choose_replica(chain, [B, A], {}, 16) == B
    with pytest.raises(ValueError):
        choose_replica(chain, [], {}, 16)


def test_choose_replica_falls_back_to_load_when_registry_is_unavailable() -> None:
    class Down(MemoryRegistry):
        def lookup(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
            raise RegistryUnavailable("down")

    chain = hashes(1, 2, 3)
    loads = {A: ReplicaLoad(3, 1), B: ReplicaLoad(0, 1)}
    assert choose_replica(chain, [A, B], loads, 16, registry=Down()) == B


def test_publisher_batches_and_coalesces() -> None:
    reg = CountingRegistry()
    pub = BlockPublisher(reg, A, flush_interval_s=60.0, max_batch=100_000)
    pub.start()
    assert pub.flush(5.0) and pub.registered
    for h in range(1000):
        pub.stored([BlockHash(h)])
    pub.removed(hashes(0, 1))
    pub.stored(hashes(1))  # last event per hash wins
    before = reg.publishes
    assert pub.flush(5.0)
    assert reg.publishes - before == 1  # 1002 calls, one publish
    assert reg.lookup(hashes(1, 2, 3)) == {A: 3}
    assert reg.lookup(hashes(0)) == {A: 0}
    pub.set_load(queued=4, running=2)
    pub.stop()  # withdraws
    assert reg.lookup(hashes(1)) == {}


def test_publisher_flushes_early_when_a_batch_is_big() -> None:
    reg = CountingRegistry()
    pub = BlockPublisher(reg, A, flush_interval_s=60.0, max_batch=100)
    pub.start()
    pub.flush(5.0)
    for h in range(1000):
        pub.stored([BlockHash(h)])
    assert wait_until(lambda: reg.lookup(hashes(*range(900)))[A] == 900)  # no flush() call: max_batch drove it
    assert 1 <= reg.publishes <= 10
    pub.stop()


def test_publisher_re_registers_its_full_set_after_losing_the_lease() -> None:
    reg = MemoryRegistry(lease_s=0.5)
    pub = BlockPublisher(reg, A, flush_interval_s=0.01, heartbeat_interval_s=0.05)
    pub.stored(hashes(1, 2, 3))
    pub.start()
    assert pub.flush(5.0)
    reg.withdraw(A)  # as if the store lost everything
    pub.stored(hashes(4))
    assert wait_until(lambda: reg.lookup(hashes(1, 2, 3, 4)).get(A) == 4)
    assert pub.registrations >= 2
    pub.stop(withdraw=False)
    assert reg.lookup(hashes(1)) == {A: 1}  # left to its lease


def test_open_registry_and_block_hashes() -> None:
    assert isinstance(open_registry(None), MemoryRegistry)
    assert isinstance(open_registry("memory"), MemoryRegistry)
    reg = open_registry("redis://127.0.0.1:1/0", lease_s=2.0)  # opening does not connect
    assert isinstance(reg, PrefixRegistry) and reg.lease_s == 2.0
    reg.close()
    with pytest.raises(ValueError):
        open_registry("etcd://somewhere")
    assert as_block_hash(-1) == (1 << 64) - 1
    assert as_block_hash(bytes(range(32))) == int.from_bytes(bytes(range(8)), "big")
    with pytest.raises(ValueError):
        as_block_hash(1 << 64)
