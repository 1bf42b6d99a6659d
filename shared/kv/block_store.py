"""The KV block store: full blocks kept beyond the paged cache, found again by their chain hash.

    engine (one thread)                               tiers
    commit of a full block  -> committed(...) -> queue -> writer thread -> local disk (files, LRU budget)
      (write_back: eviction, a clean stop; selective: eviction, reuse) -> Redis   (encode, pipelined, budget, TTL)
    eviction from the cache -> evicted(...) ------------------------------> host memory (LRU, no encoding)
    blocks another target sent -> received(...) --------------------------> host memory
    prefix-cache miss       -> lookup(hashes) <- host first, then disk, then Redis, the last only while reading
                                                 is cheaper than computing (shared.kv.transfer_cost)

The block hash already names the model and the request's cache salt (shared.kv.hashing), so tenants never share a
block; each value also carries the model fingerprint, dtype, layout and a checksum (shared.kv.block_codec), a MAC
under the store key where one is set, and a value that fails any check is a miss. Writes never hold up a step: the
engine thread hands over tensors it already copied out of the cache, and when the writer falls behind by more than
`max_pending_bytes` new writes are dropped.
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
from shared.kv.block_codec import BlockData, BlockLayout, InvalidBlock, decode, encode, store_mac_key
from shared.kv.disk_tier import DiskTier
from shared.kv.hashing import BlockHash
from shared.kv.host_tier import HostTier
from shared.kv.redis_tier import RedisTier
from shared.kv.transfer_cost import TransferCost

log = logging.getLogger(__name__)

WRITE_BATCH = 16              # blocks per Redis write
KNOWN_HASHES = 65536          # hashes remembered as already in Redis (not written again)
MAX_COUNTED = 65536           # blocks whose matches write_through_selective counts at a time
WRITER_NICE = 10              # the writer thread's nice value: encoding and sending yield to the forward passes


class KVBlockStore:
    def __init__(self, layout: BlockLayout, *, host_bytes: int = 0, remote: RedisTier | None = None,
                 disk: DiskTier | None = None, max_pending_bytes: int = 256 << 20,
                 write_policy: str = "write_through", write_threshold: int = 1, key: bytes | None = None) -> None:
        self.layout = layout
        self.key = key                             # the MAC key of every value on disk and in Redis (None: checksums)
        # when blocks go to disk and Redis: as they fill (write_through); as the cache evicts them, and at a clean
        # stop (write_back); as they are evicted or first reused from the cache (write_through_selective)
        self.write_policy = write_policy
        self.write_threshold = write_threshold     # write_through_selective: matches before a block is written
        self._matches: OrderedDict[BlockHash, int] = OrderedDict()     # matches so far of blocks not yet due
        self.tag = layout.key_tag()
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.remote = remote
        self.disk = disk
        self.cost = TransferCost(layout.kv_bytes, layout.block_size)
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._known: OrderedDict[BlockHash, None] = OrderedDict()    # written (or read) as far as this process knows
        self._queue: queue.Queue[list[tuple[BlockHash, BlockData]] | threading.Event | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if remote is not None or disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
            self._writer.start()

    @property
    def writes(self) -> bool:
        """Whether there is a tier that blocks are written to (disk or Redis)."""
        return self.remote is not None or self.disk is not None

    @property
    def wants_commits(self) -> bool:
        return self.writes and self.write_policy == "write_through"

    @property
    def wants_evictions(self) -> bool:
        return self.host is not None or (self.writes and self.write_policy != "write_through")

    @property
    def wants_reuse(self) -> bool:
        return self.writes and self.write_policy == "write_through_selective"

    @property
    def wants_cache_at_stop(self) -> bool:
        return self.writes and self.write_policy == "write_back"

    def known(self, h: BlockHash) -> bool:
        """Whether this process wrote (or read) the block: it need not be written again."""
        return h in self._known

    def count_match(self, h: BlockHash) -> bool:
        """Counts a new request's match of the cached block `h` (write_through_selective) -> whether the block is
        now due: matched write_threshold times and not written yet. Counts of the MAX_COUNTED blocks matched
        last are kept."""
        if h in self._known:
            return False
        n = self._matches.pop(h, 0) + 1
        if n >= self.write_threshold:
            return True
        self._matches[h] = n
        if len(self._matches) > MAX_COUNTED:
            self._matches.popitem(last=False)
        return False

    # ---------------------------------------------------------------- reads (engine thread)
    def lookup(self, hashes: Sequence[BlockHash]) -> list[BlockData]:
        """The blocks of the longest run of `hashes` from the first that the tiers hold and that are worth reading."""
        out: list[BlockData] = []
        if self.host is not None:
            for h in hashes:
                block = self.host.get(h)
                if block is None:
                    break
                out.append(block)
            if out:
                metrics.KV_STORE_HITS.labels("host").inc(len(out))
                metrics.KV_STORE_BYTES.labels("read").inc(sum(b.nbytes for b in out))
        if self.disk is not None and len(out) < len(hashes):
            out += self._read_disk(hashes[len(out):])
        rest = hashes[len(out):]
        if rest and self.remote is not None:
            if not self.cost.worth_reading(len(rest)):
                metrics.KV_STORE_SKIPPED.inc(len(rest))
                return out
            out += self._read_remote(rest)
        if len(out) < len(hashes):
            metrics.KV_STORE_MISSES.inc(len(hashes) - len(out))
        return out

    def _read_disk(self, hashes: Sequence[BlockHash]) -> list[BlockData]:
        out, size = [], 0
        for h in hashes:
            value = self.disk.get(h)
            if value is None:
                break
            try:
                out.append(decode(h, self.layout, value, self.key))
            except InvalidBlock as e:
                _count_invalid(e)
                log.warning("KV block file %s not used: %s", self.disk.path(h), e)
                self.disk.drop(h)
                break
            size += len(value)
            self._remember(h)
        if out:
            metrics.KV_STORE_HITS.labels("disk").inc(len(out))
            metrics.KV_STORE_BYTES.labels("read").inc(size)
        return out

    def _read_remote(self, hashes: Sequence[BlockHash]) -> list[BlockData]:
        t0 = time.perf_counter()
        values = self.remote.get_leading(self.tag, hashes)
        seconds = time.perf_counter() - t0
        size = sum(len(v) for v in values)
        self.cost.observe_read(size, seconds)
        metrics.KV_STORE_READ_SECONDS.observe(seconds)
        out = []
        for h, value in zip(hashes, values):
            try:
                out.append(decode(h, self.layout, value, self.key))
            except InvalidBlock as e:
                _count_invalid(e)
                log.warning("KV store value for block %016x not used: %s", h, e)
                break
            self._remember(h)
        if out:
            metrics.KV_STORE_HITS.labels("redis").inc(len(out))
            metrics.KV_STORE_BYTES.labels("read").inc(sum(len(v) for v in values[:len(out)]))
        return out

    # ---------------------------------------------------------------- writes (engine thread hands over)
    def evicted(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Blocks the paged cache is about to overwrite (copies): into host memory, and unless the policy is
        write_through (which wrote them as they filled) queued for the disk and Redis tiers."""
        if self.host is not None:
            for h, block in items:
                self.host.put(h, block)
        if self.writes and self.write_policy != "write_through":
            self._enqueue(items)

    def reused(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Cached blocks another sequence just matched (a shared prefix): queued for the disk and Redis tiers
        (write_through_selective)."""
        if self.wants_reuse:
            self._enqueue(items)

    def received(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Blocks another target sent (prefill/decode disaggregation, direct transfer): into host memory."""
        for h, block in items:
            self.host.put(h, block)
        metrics.KV_STORE_BYTES.labels("received").inc(sum(b.nbytes for _, b in items))

    def committed(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Newly filled blocks: queued for the disk and Redis tiers (write_through)."""
        if self.wants_commits:
            self._enqueue(items)

    def stopping(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Some of the blocks the cache still holds at a clean stop: written to the disk and Redis tiers
        (write_back), waiting for the writer (so that a whole cache passes under the pending-bytes bound)."""
        if self.wants_cache_at_stop:
            self._enqueue(items)
            self.flush()

    def _enqueue(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
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
            self._remember(h)
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
            if self.remote is not None:
                self.remote.close()

    def _remember(self, h: BlockHash) -> None:
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


def _count_invalid(e: InvalidBlock) -> None:
    metrics.KV_STORE_INVALID.inc()
    if e.forged:
        metrics.KV_STORE_FORGED.inc()


def open_block_store(layout: BlockLayout, url: str | None, budget_gb: float, ttl_s: float, host_gb: float,
                     disk_dir: str | None = None, disk_gb: float = 10.0, write_policy: str = "write_through",
                     write_threshold: int = 1, key: str | None = None) -> KVBlockStore | None:
    """The store the settings ask for: a Redis tier when `url` is set, a host tier when host_gb > 0, a disk tier
    when disk_dir is set; None when none is. write_policy, write_threshold: when blocks go to disk and Redis
    (KVBlockStore); key: the store key that authenticates every value on disk and in Redis."""
    if not url and host_gb <= 0 and not disk_dir:
        return None
    if (url or disk_dir) and not key:
        log.warning("KV blocks on disk and in Redis are checked, not authenticated: whoever can write there can "
                    "change them; set --kv-store-key (the same on every target)")
    remote = RedisTier(url, budget_bytes=int(budget_gb * 2**30), ttl_s=ttl_s) if url else None
    disk = DiskTier(disk_dir, int(disk_gb * 2**30), layout.key_tag()) if disk_dir else None
    return KVBlockStore(layout, host_bytes=int(host_gb * 2**30), remote=remote, disk=disk,
                        write_policy=write_policy, write_threshold=write_threshold,
                        key=store_mac_key(key) if key else None)
