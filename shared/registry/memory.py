"""In-process registry backend: the embedded default of a single-machine run, and the reference for the Redis one.

State per replica: a set of held hashes, the last reported load and a lease deadline on `clock` (monotonic seconds;
tests pass a fake clock). An expired replica is dropped lazily, on the next call that touches it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from shared.registry.base import DEFAULT_LEASE_S, BlockHash, PrefixRegistry, ReplicaId, ReplicaLoad


@dataclass(slots=True)
class _Replica:
    deadline: float
    load: ReplicaLoad
    held: set[BlockHash] = field(default_factory=set)


class MemoryRegistry(PrefixRegistry):
    """`PrefixRegistry` in a dict, safe to share between threads of one process."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(lease_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._replicas: dict[ReplicaId, _Replica] = {}

    def _live(self) -> dict[ReplicaId, _Replica]:
        now = self._clock()
        for replica in [r for r, state in self._replicas.items() if state.deadline <= now]:
            del self._replicas[replica]
        return self._replicas

    def register(self, replica: ReplicaId, held: Iterable[BlockHash], load: ReplicaLoad) -> None:
        with self._lock:
            self._replicas[replica] = _Replica(self._clock() + self.lease_s, load, set(held))

    def heartbeat(self, replica: ReplicaId, load: ReplicaLoad) -> bool:
        with self._lock:
            state = self._live().get(replica)
            if state is None:
                return False
            state.deadline = self._clock() + self.lease_s
            state.load = load
            return True

    def publish(self, replica: ReplicaId, stored: Sequence[BlockHash] = (), removed: Sequence[BlockHash] = ()) -> None:
        with self._lock:
            state = self._live().get(replica)
            if state is None:
                return  # no lease: the writer's next heartbeat fails and it registers its full set
            state.held.difference_update(removed)
            state.held.update(stored)

    def withdraw(self, replica: ReplicaId) -> None:
        with self._lock:
            self._replicas.pop(replica, None)

    def lookup(self, chain: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        with self._lock:
            result: dict[ReplicaId, int] = {}
            for replica, state in self._live().items():
                n = 0
                while n < len(chain) and chain[n] in state.held:
                    n += 1
                result[replica] = n
            return result

    def loads(self) -> dict[ReplicaId, ReplicaLoad]:
        with self._lock:
            return {replica: state.load for replica, state in self._live().items()}
