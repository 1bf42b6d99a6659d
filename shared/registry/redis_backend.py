"""Redis registry backend (compose, Kubernetes, integration tests), URL `redis://host:port/db`.

Key layout (`P` = key prefix, default "upesi:reg"; block hashes are stored as decimal strings):

    P:replicas            SET     ids of replicas that registered; an id whose lease key is gone is pruned by readers
    P:lease:{replica}     STRING  the replica's last load report, JSON {"queued": q, "running": r}; PX = lease.
                                  Its existence *is* the lease: the replica is live while this key is.
    P:blocks:{replica}    SET     block hashes the replica holds; PX = lease, renewed by every heartbeat and publish,
                                  so a replica that stops heartbeating loses its whole set when the lease runs out.

Writes (one writer per replica, its `BlockPublisher`), each one MULTI/EXEC round trip:
    register   DEL blocks; SADD blocks h...; PEXPIRE blocks; SET lease PX; SADD replicas
    heartbeat  SET lease PX XX; PEXPIRE blocks; SADD replicas   (SET ... XX fails if the lease was lost -> register)
    publish    SREM blocks h...; SADD blocks h...; PEXPIRE blocks
    withdraw   DEL blocks lease; SREM replicas
Lookup of a chain h0, h1, ... (pipelined, stops at the first miss):
    1. SMEMBERS replicas
    2. MGET the leases (who is live) + SMISMEMBER blocks:{r} h0..h31 for each replica, in one pipeline
    3. keep only the replicas that held every hash of the chunk, ask them for the next chunk (twice as long), and so on;
       the scan ends as soon as no replica is still matching, i.e. at the first block no matching replica holds.

Unreachable Redis: every call raises `RegistryUnavailable` (the outage is logged once), and for `retry_after_s` after a
failure calls fail at once without touching the network, so a router is never held up by a dead store; afterwards the
next call tries to connect again. Keys are computed per replica, so this layout needs a single Redis, not a Cluster.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.registry.base import (
    DEFAULT_LEASE_S,
    BlockHash,
    PrefixRegistry,
    RegistryUnavailable,
    ReplicaId,
    ReplicaLoad,
)

log = logging.getLogger(__name__)

_MAX_ARGS = 1024  # hashes per SADD/SREM command, so one huge register stays a series of moderate commands

# Drop a replica id from the replicas set only if its lease is still gone when the script runs, so a replica that
# re-registers between a reader's MGET and this prune keeps its place.
_PRUNE = "if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('SREM', KEYS[1], ARGV[1]) end return 0"


class RedisRegistry(PrefixRegistry):
    """`PrefixRegistry` on one Redis. `round_trips` counts requests sent to Redis (one per command or pipeline)."""

    def __init__(
        self,
        url: str,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        prefix: str = "upesi:reg",
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        first_chunk: int = 32,
    ) -> None:
        super().__init__(lease_s)
        if first_chunk <= 0:
            raise ValueError(f"first_chunk must be > 0, got {first_chunk}")
        # One quick retry on a fresh connection covers a pooled connection that a Redis restart broke; no backoff,
        # because waiting is what `retry_after_s` is for.
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        kw = self._redis.connection_pool.connection_kwargs
        self._where = f"{url.partition(':')[0]}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
        self._prefix = prefix
        self._lease_ms = max(1, round(lease_s * 1000))
        self._retry_after_s = retry_after_s
        self._first_chunk = first_chunk
        self._state_lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.round_trips = 0

    # -- keys and plumbing ------------------------------------------------------------------------------------------

    def _replicas_key(self) -> str:
        return f"{self._prefix}:replicas"

    def _lease_key(self, replica: ReplicaId) -> str:
        return f"{self._prefix}:lease:{replica}"

    def _blocks_key(self, replica: ReplicaId) -> str:
        return f"{self._prefix}:blocks:{replica}"

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Map redis connection failures to `RegistryUnavailable`, log each outage once, hold off retries briefly."""
        if time.monotonic() < self._down_until:
            raise RegistryUnavailable(f"prefix registry at {self._where} is unreachable (retrying later)")
        try:
            yield
        except (redis.RedisError, ValueError) as e:
            # Not only lost connections: an error reply (WRONGTYPE, READONLY, NOPERM, OOM) or a value this code cannot
            # read means the index cannot be used now either, and routing by load is the answer to both.
            what = "unreachable" if isinstance(e, (redis.ConnectionError, redis.TimeoutError)) else "failing"
            with self._state_lock:
                self._down_until = time.monotonic() + self._retry_after_s
                first = not self._down
                self._down = True
            if first:
                log.warning("prefix registry at %s is %s (%s: %s); routing by load until it recovers",
                            self._where, what, type(e).__name__, e)
            raise RegistryUnavailable(f"prefix registry at {self._where} is {what}: {e}") from e
        if self._down:
            with self._state_lock:
                self._down = False
            log.info("prefix registry at %s is reachable again", self._where)

    def _execute(self, pipe: Any) -> list[Any]:
        self.round_trips += 1
        return pipe.execute()

    def _run(self, build: Callable[[Any], None], *, transaction: bool = True) -> list[Any]:
        with self._guard():
            pipe = self._redis.pipeline(transaction=transaction)
            build(pipe)
            return self._execute(pipe)

    @staticmethod
    def _members(hashes: Iterable[BlockHash]) -> list[str]:
        return [str(h) for h in hashes]

    # -- writers ----------------------------------------------------------------------------------------------------

    def register(self, replica: ReplicaId, held: Iterable[BlockHash], load: ReplicaLoad) -> None:
        blocks, members = self._blocks_key(replica), self._members(held)

        def build(pipe: Any) -> None:
            pipe.delete(blocks)
            for i in range(0, len(members), _MAX_ARGS):
                pipe.sadd(blocks, *members[i : i + _MAX_ARGS])
            pipe.pexpire(blocks, self._lease_ms)
            pipe.set(self._lease_key(replica), _encode_load(load), px=self._lease_ms)
            pipe.sadd(self._replicas_key(), replica)

        self._run(build)

    def heartbeat(self, replica: ReplicaId, load: ReplicaLoad) -> bool:
        def build(pipe: Any) -> None:
            pipe.set(self._lease_key(replica), _encode_load(load), px=self._lease_ms, xx=True)
            pipe.pexpire(self._blocks_key(replica), self._lease_ms)
            pipe.sadd(self._replicas_key(), replica)

        return bool(self._run(build)[0])

    def publish(self, replica: ReplicaId, stored: Sequence[BlockHash] = (), removed: Sequence[BlockHash] = ()) -> None:
        if not stored and not removed:
            return
        blocks, added, dropped = self._blocks_key(replica), self._members(stored), self._members(removed)

        def build(pipe: Any) -> None:
            for i in range(0, len(dropped), _MAX_ARGS):
                pipe.srem(blocks, *dropped[i : i + _MAX_ARGS])
            for i in range(0, len(added), _MAX_ARGS):
                pipe.sadd(blocks, *added[i : i + _MAX_ARGS])
            pipe.pexpire(blocks, self._lease_ms)

        self._run(build)

    def withdraw(self, replica: ReplicaId) -> None:
        def build(pipe: Any) -> None:
            pipe.delete(self._blocks_key(replica), self._lease_key(replica))
            pipe.srem(self._replicas_key(), replica)

        self._run(build)

    # -- readers ----------------------------------------------------------------------------------------------------

    def _candidates(self) -> list[ReplicaId]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.smembers(self._replicas_key())
        out = []
        for m in self._execute(pipe)[0]:
            try:
                out.append(ReplicaId(m.decode()))
            except UnicodeDecodeError:                  # not written by a target: never a replica to route to
                log.debug("prefix registry: ignoring a replica entry that is not UTF-8: %r", m[:64])
        return sorted(out)

    def _prune(self, dead: list[ReplicaId]) -> None:
        """Drops replicas whose lease expired. Housekeeping only: a reader that may not write (a read-only user,
        a replica of Redis) leaves them to the targets' own registration and still routes."""
        if dead:
            pipe = self._redis.pipeline(transaction=False)
            for replica in dead:
                pipe.eval(_PRUNE, 2, self._replicas_key(), self._lease_key(replica), replica)
            try:
                self._execute(pipe)
            except redis.ResponseError as e:
                log.debug("prefix registry: cannot prune expired replicas (%s)", e)

    def loads(self) -> dict[ReplicaId, ReplicaLoad]:
        with self._guard():
            candidates = self._candidates()
            if not candidates:
                return {}
            pipe = self._redis.pipeline(transaction=False)
            pipe.mget([self._lease_key(r) for r in candidates])
            leases = self._execute(pipe)[0]
            self._prune([r for r, v in zip(candidates, leases, strict=True) if v is None])
            return {r: _decode_load(v) for r, v in zip(candidates, leases, strict=True) if v is not None}

    def lookup(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        members = self._members(chain)
        with self._guard():
            candidates = self._candidates()
            if not candidates:
                return {}
            # Round trip 2: leases and the first chunk together.
            chunk = members[: self._first_chunk]
            pipe = self._redis.pipeline(transaction=False)
            pipe.mget([self._lease_key(r) for r in candidates])
            for r in candidates:
                if chunk:
                    pipe.smismember(self._blocks_key(r), chunk)
            replies = self._execute(pipe)
            leases, flags = replies[0], replies[1:]
            self._prune([r for r, v in zip(candidates, leases, strict=True) if v is None])
            live = [r for r, v in zip(candidates, leases, strict=True) if v is not None]
            held = {r: 0 for r in live}
            if not chunk:
                return held
            matching = _extend(held, {r: f for r, f, v in zip(candidates, flags, leases, strict=True) if v is not None})
            start, size = len(chunk), 2 * len(chunk)
            while matching and start < len(members):
                chunk = members[start : start + size]
                pipe = self._redis.pipeline(transaction=False)
                for r in matching:
                    pipe.smismember(self._blocks_key(r), chunk)
                matching = _extend(held, dict(zip(matching, self._execute(pipe), strict=True)))
                start, size = start + len(chunk), 2 * size
            return held

    def close(self) -> None:
        self._redis.close()


def _extend(held: dict[ReplicaId, int], flags: dict[ReplicaId, list[Any]]) -> list[ReplicaId]:
    """Add each replica's run of leading hits in this chunk; return those that hit the whole chunk (scan on)."""
    matching = []
    for replica, hits in flags.items():
        run = next((i for i, hit in enumerate(hits) if not hit), len(hits))
        held[replica] += run
        if run == len(hits):
            matching.append(replica)
    return matching


def _encode_load(load: ReplicaLoad) -> str:
    return json.dumps({"queued": load.queued, "running": load.running})


def _decode_load(raw: bytes) -> ReplicaLoad:
    fields = json.loads(raw)
    return ReplicaLoad(int(fields.get("queued", 0)), int(fields.get("running", 0)))
