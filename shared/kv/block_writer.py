"""The KV block store's writes: a queue the engine thread hands full blocks to, and one thread that encodes them
and writes them to the disk tier and to Redis (shared.kv.block_store).

Writes never hold up a step: when the writer falls behind by more than `max_pending_bytes`, new writes are dropped.
The hashes of blocks written (or read) are remembered, KNOWN_HASHES of them, so a block is not written twice.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from shared import metrics
from shared.kv.block_codec import BlockData, BlockLayout, encode
from shared.kv.disk_tier import DiskTier
from shared.kv.hashing import BlockHash
from shared.kv.redis_tier import RedisTier

log = logging.getLogger(__name__)

WRITE_BATCH = 16              # blocks per Redis write
KNOWN_HASHES = 65536          # hashes remembered as already in Redis (not written again)
WRITER_NICE = 10              # the writer thread's nice value: encoding and sending yield to the forward passes


class BlockWriter:
    def __init__(self, layout: BlockLayout, remote: RedisTier | None, disk: DiskTier | None, key: bytes | None,
                 max_pending_bytes: int) -> None:
        self.layout, self.remote, self.disk, self.key = layout, remote, disk, key
        self.tag = layout.key_tag()
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._known: OrderedDict[BlockHash, None] = OrderedDict()    # written (or read) as far as this process knows
        self._queue: queue.Queue[list[tuple[BlockHash, BlockData]] | threading.Event | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if remote is not None or disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
            self._writer.start()

    def known(self, h: BlockHash) -> bool:
        return h in self._known

    def enqueue(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Queued for the writer, unless known to be written already or the writer is too far behind."""
        new = [(h, b) for h, b in items if h not in self._known]
        if not new:
            return
        size = sum(b.nbytes for _, b in new)
        with self._pending_lock:
            if self._pending_bytes + size > self.max_pending_bytes:
                metrics.KV_STORE_DROPPED.inc(len(new))
                return
            self._pending_bytes += size
        for h, _ in new:
            self.remember(h)
        self._queue.put(new)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every queued write went out (or failed); False on timeout."""
        if self._writer is None:
            return True
        done = threading.Event()
        self._queue.put(done)                             # the writer sets it when it gets there
        return done.wait(timeout_s)

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=30)
            self._writer = None

    def remember(self, h: BlockHash) -> None:
        self._known[h] = None
        self._known.move_to_end(h)
        if len(self._known) > KNOWN_HASHES:
            self._known.popitem(last=False)

    def _write_disk(self, batch: list[tuple[BlockHash, bytes]]) -> None:
        """Writes a batch to the disk tier; a block that fails (a full disk) is counted and forgotten, so that its
        next commit tries again, and the rest of the batch, and Redis, go on."""
        written, failed, error = 0, 0, None
        for h, v in batch:
            try:
                self.disk.put(h, v)
                written += len(v)
            except OSError as e:
                failed, error = failed + 1, e
                self._known.pop(h, None)
        metrics.KV_STORE_BYTES.labels("write").inc(written)
        if failed:
            metrics.KV_STORE_WRITE_FAILURES.labels("disk").inc(failed)
            log.warning("%d KV blocks not written to the disk tier: %s", failed, error)

    def _write_loop(self) -> None:
        try:                                     # Linux: a thread's own nice value; the steps' threads go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            items = self._queue.get()
            if items is None:
                return
            if isinstance(items, threading.Event):
                items.set()
                continue
            size = sum(b.nbytes for _, b in items)
            try:
                for start in range(0, len(items), WRITE_BATCH):
                    batch = [(h, encode(h, self.layout, b, self.key)) for h, b in items[start:start + WRITE_BATCH]]
                    if self.disk is not None:
                        self._write_disk(batch)
                    if self.remote is None:
                        continue
                    t0 = time.perf_counter()
                    if self.remote.put(self.tag, batch):
                        metrics.KV_STORE_WRITE_SECONDS.observe(time.perf_counter() - t0)
                        metrics.KV_STORE_BYTES.labels("write").inc(sum(len(v) for _, v in batch))
                    else:
                        metrics.KV_STORE_WRITE_FAILURES.labels("redis").inc(len(batch))
                        for h, _ in batch:
                            self._known.pop(h, None)
            except Exception:                                 # a writer that dies would leak the pending bytes
                log.exception("KV store write failed")
            finally:
                with self._pending_lock:
                    self._pending_bytes -= size
