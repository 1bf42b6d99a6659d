"""The prefix-block registry: which target replica holds which full KV block, and how busy each replica is.

The registry is an eventually consistent *index* (docs/architecture.md): each replica's block manager stays the
authority on its own blocks, publishes what it stores and evicts through a `BlockPublisher` (batched, off the per-token
path), and heartbeats a lease; the router reads the index through `lookup` and picks a replica with `choose_replica`.
Losing the index never stops serving: routing falls back to load, and publishers re-register their full sets later.

    router                              registry                              target replica
    chain = [h0, h1, h2, ...] ──lookup──►  {replica: leading blocks held}  ◄──publish(stored, removed)── block manager
    choose_replica(chain, ...)          ◄──────── loads ─────────────────  ◄──heartbeat(load) every lease/3

A chain is the block-hash chain of one prompt: h[i] = hash(h[i-1], tokens of full block i, extra), so holding h[i]
implies the whole prefix up to block i, and a replica's cached prefix is the run of leading hashes it holds.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NewType

from shared.kv.hashing import BlockHash

ReplicaId = NewType("ReplicaId", str)  # a target replica's stable name, e.g. its gRPC address "target-0:50052"

DEFAULT_LEASE_S = 10.0
_UINT64 = 1 << 64

log = logging.getLogger(__name__)


class RegistryError(Exception):
    """Base of the registry's own errors."""


class RegistryUnavailable(RegistryError):
    """The registry's store cannot be reached now; callers carry on without it (route by load, re-register later)."""


def as_block_hash(value: int | bytes) -> BlockHash:
    """A `BlockHash` from a 64-bit int (signed or unsigned) or a digest (its first 8 bytes, big-endian)."""
    if isinstance(value, bytes):
        if len(value) < 8:
            raise ValueError(f"a block-hash digest needs at least 8 bytes, got {len(value)}")
        return BlockHash(int.from_bytes(value[:8], "big"))
    if not -(1 << 63) <= value < _UINT64:
        raise ValueError(f"block hash {value} does not fit in 64 bits")
    return BlockHash(value % _UINT64)


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """Requests a replica has waiting for a slot (`queued`) and in its running batch (`running`)."""

    queued: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        if self.queued < 0 or self.running < 0:
            raise ValueError(f"load counts must be >= 0, got queued={self.queued} running={self.running}")

    @property
    def total(self) -> int:
        return self.queued + self.running


class PrefixRegistry(ABC):
    """Cluster-wide index: replica -> the full-block hashes it holds, plus a lease and a load report per replica.

    Writers are target replicas (through `BlockPublisher`, one thread per replica, so one writer per replica id):
      register(replica, held, load)   (re)announce a replica with its complete set of held hashes; starts its lease
      heartbeat(replica, load)        extend the lease and report load; False means the lease was lost (expired, or the
                                      store restarted empty), so the writer must `register` again with its full set
      publish(replica, stored, removed)  apply one batch of changes
      withdraw(replica)               graceful stop: drop the lease and every entry now
    Readers are routers:
      lookup(chain) -> {live replica: number of leading hashes of `chain` it holds}
      loads()       -> {live replica: its last reported load}

    A replica is live while its lease (`lease_s`, renewed by heartbeats) runs; once it lapses, its entries disappear
    from `lookup` and `loads`. Backends that talk to a remote store raise `RegistryUnavailable` when it cannot be
    reached; the memory backend never does.
    """

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s

    @abstractmethod
    def register(self, replica: ReplicaId, held: Iterable[BlockHash], load: ReplicaLoad) -> None: ...

    @abstractmethod
    def heartbeat(self, replica: ReplicaId, load: ReplicaLoad) -> bool: ...

    @abstractmethod
    def publish(
        self, replica: ReplicaId, stored: Sequence[BlockHash] = (), removed: Sequence[BlockHash] = ()
    ) -> None: ...

    @abstractmethod
    def withdraw(self, replica: ReplicaId) -> None: ...

    @abstractmethod
    def lookup(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]: ...

    @abstractmethod
    def loads(self) -> dict[ReplicaId, ReplicaLoad]: ...

    def close(self) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Release connections; the default holds none."""


# How many prompt tokens of prefill one request already queued or running on a replica is worth: a replica with one
# more request in flight wins only if it saves more than this many tokens of prefill.
DEFAULT_TOKENS_PER_REQUEST = 256


def choose_replica(
    chain: Sequence[BlockHash],
    replicas: Sequence[ReplicaId],
    loads: Mapping[ReplicaId, ReplicaLoad],
    block_size: int,
    *,
    registry: PrefixRegistry | None = None,
    tokens_per_request: int = DEFAULT_TOKENS_PER_REQUEST,
) -> ReplicaId:
    """Pick the replica of `replicas` with the least work for this prompt: prefill it must still do, plus its load.

        cost(r) = (len(chain) - cached_blocks(r)) * block_size  +  tokens_per_request * (queued(r) + running(r))

    `cached_blocks` comes from `registry.lookup(chain)`; with no registry, or one that is unreachable, every replica
    counts as holding nothing and the choice is by load alone. Replicas missing from `loads` count as idle. Ties go to
    the lower load, then to the earlier replica in `replicas`.
    """
    if not replicas:
        raise ValueError("no target replicas to choose from")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    cached: Mapping[ReplicaId, int] = {}
    if registry is not None and chain:
        try:
            cached = registry.lookup(chain)
        except RegistryUnavailable:
            cached = {}  # the backend logs the outage once; route by load until it returns

    def key(item: tuple[int, ReplicaId]) -> tuple[int, int, int]:
        index, replica = item
        load = loads.get(replica, ReplicaLoad()).total
        uncached_tokens = (len(chain) - cached.get(replica, 0)) * block_size
        return uncached_tokens + tokens_per_request * load, load, index

    return min(enumerate(replicas), key=key)[1]
