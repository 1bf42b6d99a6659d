"""The Redis tier of the KV block store, URL `redis://[:password@]host:port/db`: shared by every target.

Key layout (`P` = key prefix, default "upesi:kv"; `tag` = the model fingerprint's first 8 bytes in hex, so another
model or dtype never even reads these values; `hash` = the block's chain hash, 16 hex digits):

    P:{tag}:{hash}   STRING  one encoded block (shared.kv.block_codec), binary; PX = the TTL, renewed on each read
    P:lru            ZSET    value keys by last write or read time (ms)
    P:sizes          HASH    value key -> its size in bytes
    P:bytes          STRING  the sum of those sizes

Writes go through one Lua script per batch (SET PX, then evict the least recently used values while the sum exceeds
the budget), so the budget holds with many writers. Reads are pipelined MGETs in chunks, stopping at the first chunk
with a missing value. Values that expired by TTL stay counted until they reach the head of the LRU order.

An unreachable, failing or frozen Redis is a miss (reads) or a dropped write. Reads run on the engine thread, so
they get their own connection with a short socket timeout (`read_timeout_s`): a store that stops answering holds a
step once, for that long. From then on no read or write touches the network; a background thread pings the store
every `retry_after_s` and lets them through again once it answers, so serving never waits on a dead store.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.kv.hashing import BlockHash

log = logging.getLogger(__name__)

READ_CHUNK = 16

# KEYS: lru, sizes, bytes, value keys...; ARGV: budget, ttl_ms, now_ms, values... (ARGV[3 + i] goes to KEYS[3 + i])
_PUT = """
local budget, ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 4, #KEYS do
  local key, value = KEYS[i], ARGV[i]
  local old = redis.call('HGET', KEYS[2], key)
  if old then redis.call('DECRBY', KEYS[3], tonumber(old)) end
  redis.call('SET', key, value, 'PX', ttl)
  redis.call('HSET', KEYS[2], key, #value)
  redis.call('INCRBY', KEYS[3], #value)
  redis.call('ZADD', KEYS[1], now, key)
end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local evicted = 0
while total > budget do
  local oldest = redis.call('ZPOPMIN', KEYS[1])
  if #oldest == 0 then break end
  local size = tonumber(redis.call('HGET', KEYS[2], oldest[1]) or '0')
  redis.call('HDEL', KEYS[2], oldest[1])
  redis.call('DEL', oldest[1])
  total = redis.call('DECRBY', KEYS[3], size)
  evicted = evicted + 1
end
return evicted
"""


class RedisTier:
    def __init__(self, url: str, *, budget_bytes: int, ttl_s: float, prefix: str = "upesi:kv",
                 timeout_s: float = 2.0, read_timeout_s: float = 0.5, retry_after_s: float = 5.0) -> None:
        if budget_bytes <= 0 or ttl_s <= 0:
            raise ValueError(f"the Redis KV store needs a positive budget and TTL, got {budget_bytes} B, {ttl_s} s")
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 1))
        self._reader = redis.Redis.from_url(url, socket_timeout=read_timeout_s,           # the engine thread's
                                            socket_connect_timeout=read_timeout_s, retry=Retry(NoBackoff(), 0))
        kw = self._redis.connection_pool.connection_kwargs
        self.where = f"{url.partition(':')[0]}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
        self.budget_bytes, self.ttl_ms = budget_bytes, max(1, round(ttl_s * 1000))
        self.prefix = prefix
        self._put = self._redis.register_script(_PUT)
        self._retry_after_s = retry_after_s
        self._down = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.evicted = 0                      # values this process's writes pushed out of the budget

    def key(self, tag: str, h: BlockHash) -> str:
        return f"{self.prefix}:{tag}:{h:016x}"

    def _meta(self) -> tuple[str, str, str]:
        return f"{self.prefix}:lru", f"{self.prefix}:sizes", f"{self.prefix}:bytes"

    def _available(self) -> bool:
        return not self._down

    def _failed(self, e: Exception) -> None:
        with self._lock:
            first, self._down = not self._down, True
        if first:
            log.warning("KV store at %s is unreachable, failing or not answering (%s: %s); computing blocks "
                        "instead until it answers again", self.where, type(e).__name__, e)
            threading.Thread(target=self._probe, name="kv-store-probe", daemon=True).start()

    def _probe(self) -> None:
        """While the store is down: a PING every retry_after_s, off the engine thread; the first answer ends it."""
        while not self._closed.wait(self._retry_after_s):
            try:
                self._redis.ping()
            except redis.RedisError:
                continue
            with self._lock:
                self._down = False
            log.info("KV store at %s is reachable again", self.where)
            return

    def get_leading(self, tag: str, hashes: Sequence[BlockHash]) -> list[bytes]:
        """The values of the longest run of `hashes` from the first that the store holds (each read renews its TTL
        and LRU place); an empty list when Redis is down."""
        if not hashes or not self._available():
            return []
        out: list[bytes] = []
        lru = self._meta()[0]
        try:
            for start in range(0, len(hashes), READ_CHUNK):
                keys = [self.key(tag, h) for h in hashes[start:start + READ_CHUNK]]
                values = self._reader.mget(keys)
                found = 0
                for v in values:
                    if v is None:
                        break
                    out.append(v)
                    found += 1
                if found:
                    now = int(time.time() * 1000)
                    pipe = self._reader.pipeline(transaction=False)
                    pipe.zadd(lru, {k: now for k in keys[:found]}, xx=True)
                    for k in keys[:found]:
                        pipe.pexpire(k, self.ttl_ms)
                    pipe.execute()
                if found < len(keys):
                    break
        except redis.RedisError as e:
            self._failed(e)
        return out

    def put(self, tag: str, items: Sequence[tuple[BlockHash, bytes]]) -> bool:
        """Writes encoded blocks in one script call; False (and nothing raised) when Redis is down."""
        if not items or not self._available():
            return False
        keys = [*self._meta(), *(self.key(tag, h) for h, _ in items)]
        args = [self.budget_bytes, self.ttl_ms, int(time.time() * 1000), *(v for _, v in items)]
        try:
            self.evicted += int(self._put(keys=keys, args=args))
        except redis.RedisError as e:
            self._failed(e)
            return False
        return True

    def close(self) -> None:
        self._closed.set()
        self._redis.close()
        self._reader.close()
