"""A target replica's side of the registry: batches its block events and keeps its lease, on one background thread.

The block manager calls `stored(hashes)` / `removed(hashes)` as full blocks become cached or are evicted, and the
scheduler calls `set_load(queued, running)` once per step; all three only append or assign under a lock, so nothing on
the per-token path waits for the registry. The thread, every `flush_interval_s` (sooner once `max_batch` hashes wait):

    drain events -> coalesce (last event per hash wins) -> update `held`, the mirror of what this replica holds
                 -> publish the net change in one call (one Redis round trip)
    every heartbeat_interval_s: heartbeat(load); if the lease was lost -> register(held) (the full set)

While the registry is unreachable the mirror keeps changing and the deltas are dropped; the first successful call after
that is a `register` with the whole mirror, which rebuilds this replica's part of the index. The thread is the only
writer for its replica id, so batches and re-registrations never interleave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from shared.registry.base import BlockHash, PrefixRegistry, RegistryUnavailable, ReplicaId, ReplicaLoad

log = logging.getLogger(__name__)


class BlockPublisher:
    """Publishes one replica's stored/removed block hashes and heartbeats its lease, off the caller's thread."""

    def __init__(
        self,
        registry: PrefixRegistry,
        replica: ReplicaId,
        *,
        flush_interval_s: float = 0.05,
        max_batch: int = 512,
        heartbeat_interval_s: float | None = None,
    ) -> None:
        if not replica:
            raise ValueError("replica id must be a non-empty string")
        if flush_interval_s <= 0 or max_batch <= 0:
            raise ValueError(f"flush_interval_s and max_batch must be > 0, got {flush_interval_s}, {max_batch}")
        beat = registry.lease_s / 3 if heartbeat_interval_s is None else heartbeat_interval_s
        if not 0 < beat < registry.lease_s:
            raise ValueError(f"heartbeat_interval_s must be in (0, lease {registry.lease_s}), got {beat}")
        self.registry, self.replica = registry, replica
        self._flush_interval_s, self._max_batch, self._heartbeat_interval_s = flush_interval_s, max_batch, beat
        self._cond = threading.Condition()
        self._events: list[tuple[bool, tuple[BlockHash, ...]]] = []  # (stored?, hashes), in call order
        self._pending = 0  # hashes waiting in _events
        self._enqueued = 0  # calls to stored()/removed() so far
        self._done = 0  # of those, how many the thread has handled
        self._ready = False  # the thread made its first registration attempt
        self._flush_now = False
        self._stopping = False
        self._withdraw = True
        self._load = ReplicaLoad()
        self._thread: threading.Thread | None = None
        # Owned by the thread from start() on:
        self._held: set[BlockHash] = set()
        self._registered = False  # the registry holds our full set and a live lease, as far as we know
        self._failing = False
        self.registrations = 0  # full (re-)registrations done, e.g. 2 after one outage

    # -- called by the engine (any thread, cheap) -------------------------------------------------------------------

    def stored(self, hashes: Iterable[BlockHash]) -> None:
        """Queue hashes of full blocks this replica now holds."""
        self._enqueue(True, tuple(hashes))

    def removed(self, hashes: Iterable[BlockHash]) -> None:
        """Queue hashes of blocks this replica evicted."""
        self._enqueue(False, tuple(hashes))

    def set_load(self, queued: int, running: int) -> None:
        """Record the load the next heartbeat reports."""
        self._load = ReplicaLoad(queued, running)

    def _enqueue(self, stored: bool, hashes: tuple[BlockHash, ...]) -> None:
        with self._cond:
            self._events.append((stored, hashes))
            self._pending += len(hashes)
            self._enqueued += 1
            if self._pending >= self._max_batch:
                self._cond.notify_all()

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._loop, name=f"registry-publisher-{self.replica}", daemon=True)
        self._thread.start()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every event queued before this call was published (or dropped by an outage); False on timeout."""
        with self._cond:
            target = self._enqueued
            self._flush_now = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._flushed(target) or not self._alive(), timeout_s)
            return self._flushed(target)

    def stop(self, *, withdraw: bool = True, timeout_s: float = 5.0) -> None:
        """Publish what is queued and end the thread; `withdraw` also removes this replica from the index now,
        otherwise its entries stay until the lease runs out."""
        with self._cond:
            self._stopping, self._withdraw = True, withdraw
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def registered(self) -> bool:
        """Whether the registry last acknowledged our full set and lease."""
        return self._registered

    def _flushed(self, target: int) -> bool:
        return self._ready and self._done >= target

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the thread -------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        self._guarded(self._beat)  # register at once; events queued before start() follow as the first batch
        with self._cond:
            self._ready = True
            self._cond.notify_all()
        next_beat = time.monotonic() + self._heartbeat_interval_s
        while True:
            with self._cond:
                if not (self._stopping or self._flush_now or self._pending >= self._max_batch):
                    wait = min(self._flush_interval_s, max(0.0, next_beat - time.monotonic()))
                    self._cond.wait(wait if self._registered else self._flush_interval_s)
                events, self._events, self._pending = self._events, [], 0
                seq, stopping, self._flush_now = self._enqueued, self._stopping, False
            self._guarded(self._apply, events)
            if not self._registered or time.monotonic() >= next_beat:
                self._guarded(self._beat)
                next_beat = time.monotonic() + self._heartbeat_interval_s
            with self._cond:
                self._done = seq
                self._cond.notify_all()
            if stopping:
                break
        if self._withdraw:
            self._guarded(self.registry.withdraw, self.replica)

    def _guarded(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
            self._failing = False
        except RegistryUnavailable:
            self._registered = False  # the backend logged it; re-register once it answers
        except Exception:  # a registry fault must not end the thread: the index is optional, serving is not
            self._registered = False
            if not self._failing:
                log.exception("prefix registry call failed for replica %s; will re-register", self.replica)
            self._failing = True

    def _apply(self, events: list[tuple[bool, tuple[BlockHash, ...]]]) -> None:
        if not events:
            return
        final: dict[BlockHash, bool] = {}
        for stored, hashes in events:
            for h in hashes:
                final[h] = stored
        added = [h for h, keep in final.items() if keep and h not in self._held]
        dropped = [h for h, keep in final.items() if not keep and h in self._held]
        self._held.update(added)
        self._held.difference_update(dropped)
        if self._registered:  # otherwise the next register() carries the whole mirror
            self.registry.publish(self.replica, added, dropped)

    def _beat(self) -> None:
        load = self._load
        if self._registered and self.registry.heartbeat(self.replica, load):
            return
        self._registered = False
        self.registry.register(self.replica, self._held, load)
        self._registered = True
        self.registrations += 1
