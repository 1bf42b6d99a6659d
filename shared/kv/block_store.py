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
import time
from collections import OrderedDict
from collections.abc import Sequence

from shared import metrics
from shared.kv.block_codec import BlockData, BlockLayout, InvalidBlock, decode, store_mac_key
from shared.kv.block_writer import BlockWriter
from shared.kv.disk_tier import DiskTier
from shared.kv.hashing import BlockHash
from shared.kv.host_tier import HostTier
from shared.kv.redis_tier import RedisTier
from shared.kv.transfer_cost import TransferCost

log = logging.getLogger(__name__)

MAX_COUNTED = 65536           # blocks whose matches write_through_selective counts at a time


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
        # the queue and thread that write to disk and Redis, and the hashes known to be written (or read)
        self.writer = BlockWriter(layout, remote, disk, key, max_pending_bytes)

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
        return self.writer.known(h)

    def count_match(self, h: BlockHash) -> bool:
        """Counts a new request's match of the cached block `h` (write_through_selective) -> whether the block is
        now due: matched write_threshold times and not written yet. Counts of the MAX_COUNTED blocks matched
        last are kept."""
        if self.writer.known(h):
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
            self.writer.remember(h)
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
            self.writer.remember(h)
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
            self.writer.enqueue(items)

    def reused(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Cached blocks another sequence just matched (a shared prefix): queued for the disk and Redis tiers
        (write_through_selective)."""
        if self.wants_reuse:
            self.writer.enqueue(items)

    def received(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Blocks another target sent (prefill/decode disaggregation, direct transfer): into host memory."""
        for h, block in items:
            self.host.put(h, block)
        metrics.KV_STORE_BYTES.labels("received").inc(sum(b.nbytes for _, b in items))

    def committed(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Newly filled blocks: queued for the disk and Redis tiers (write_through)."""
        if self.wants_commits:
            self.writer.enqueue(items)

    def stopping(self, items: Sequence[tuple[BlockHash, BlockData]]) -> None:
        """Some of the blocks the cache still holds at a clean stop: written to the disk and Redis tiers
        (write_back), waiting for the writer (so that a whole cache passes under the pending-bytes bound)."""
        if self.wants_cache_at_stop:
            self.writer.enqueue(items)
            self.writer.flush()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every queued write went out (or failed); False on timeout."""
        return self.writer.flush(timeout_s)

    def close(self) -> None:
        self.writer.close()
        if self.remote is not None:
            self.remote.close()


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
