"""The KV block store with a real redis-server: blocks one engine computed are read by another (a replica, or a
restarted target) bit for bit, tenants stay apart, wrong values are misses, the budget holds, a dead store only
costs recomputation, and blocks sent directly to another engine's host tier (P/D) are read there bit for bit.
Engines run in process on a tiny Llama checkpoint in fp32."""
from __future__ import annotations

import os
import signal
import time

import pytest
import redis
import torch

from shared import metrics
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.kv.block_codec import BlockData, decode, encode
from shared.kv.hashing import cache_extra, hash_chain
from shared.sampling_params import SamplingParams

BS = 4


def make(path: str, store: str | None = None, host_gb: float = 0.0, blocks: int = 128, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=blocks, block_size=BS,
                                  max_num_batched_tokens=64, kv_store=store, kv_host_gb=host_gb, **kw))


def prompt(seed: int, n: int = 41) -> list[int]:
    return torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(eng: LLMEngine, ids: list[int], salt: str = "", tokens: int = 12) -> tuple[list[int], int]:
    """Greedy tokens and the request's cached prompt tokens."""
    eng.add_request(f"r{id(ids)}-{salt}-{tokens}", ids, SamplingParams(temperature=0, max_tokens=tokens,
                                                                      ignore_eos=True, cache_salt=salt))
    out, cached = [], None
    while eng.has_unfinished():
        for d in eng.step():
            out += d.token_ids
            cached = d.num_cached_tokens
    return out, cached


def record_logits(eng: LLMEngine) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    model = eng.runner.model
    plain = model.compute_logits

    def keep(hidden):
        out = plain(hidden)
        seen.append(out.clone())
        return out
    model.compute_logits = keep
    return seen


def refused_once(eng: LLMEngine, ids: list[int], expect: list[int], counter) -> None:
    """The prompt's 4th stored block is refused (counted once by `counter`) and computed again: same tokens."""
    before = counter._value.get()
    got, cached = run(eng, ids)
    assert got == expect and cached == 3 * BS
    assert counter._value.get() == before + 1


def value_keys(url: str) -> list[bytes]:
    r = redis.Redis.from_url(url)
    return [k for k in r.scan_iter("upesi:kv:*") if k.count(b":") == 3]


def test_a_replica_reads_what_another_computed_bit_for_bit(tiny_llama_dir, redis_url):
    ids = prompt(1)
    a = make(tiny_llama_dir, redis_url)
    expect, cached_a = run(a, ids)
    assert cached_a == 0
    assert a.kv_store.flush()
    assert len(value_keys(redis_url)) == (len(ids) + len(expect) - 1) // BS    # every full block it computed
    # B: a fresh replica (or A restarted with an empty cache) gets the prefix from Redis...
    b = make(tiny_llama_dir, redis_url)
    hits = metrics.KV_STORE_HITS.labels("redis")._value.get()
    b_logits = record_logits(b)
    got, cached_b = run(b, ids)
    assert got == expect
    assert cached_b == (len(ids) - 1) // BS * BS
    assert metrics.KV_STORE_HITS.labels("redis")._value.get() - hits == cached_b // BS
    # ... and its logits equal those of a replica that had the same prefix in its own cache (same rows computed)
    c = make(tiny_llama_dir)
    run(c, ids[:cached_b] + [7, 7, 7, 7, 7], tokens=1)             # puts the prefix into C's cache
    c_logits = record_logits(c)
    got_c, cached_c = run(c, ids)
    assert cached_c == cached_b and got_c == expect
    assert len(b_logits) == len(c_logits)
    assert all(torch.equal(x, y) for x, y in zip(b_logits, c_logits))
    for e in (a, b, c):
        e.close()
        assert e.block_manager.num_used_blocks == 0


def test_imported_kv_equals_the_computed_kv(tiny_llama_dir, redis_url):
    ids = prompt(2)
    a = make(tiny_llama_dir, redis_url)
    run(a, ids, tokens=1)
    a.kv_store.flush()
    b = make(tiny_llama_dir, redis_url)
    run(b, ids, tokens=1)
    n = len(ids) // BS
    for eng in (a, b):                                          # the finished prompt's blocks stay cached
        assert len(eng.block_manager.cached) >= (len(ids) - 1) // BS
    hashes = hash_chain(ids, BS, cache_extra(a.model_cfg.name))[:n - 1]
    kv_a = a.runner.read_blocks([a.block_manager.cached[h] for h in hashes])
    kv_b = b.runner.read_blocks([b.block_manager.cached[h] for h in hashes])
    assert all(torch.equal(x[0], y[0]) for x, y in zip(kv_a, kv_b))
    a.close()
    b.close()


def test_tenants_never_read_each_others_blocks(tiny_llama_dir, redis_url):
    ids = prompt(3)
    a = make(tiny_llama_dir, redis_url)
    run(a, ids, salt="tenant-1")
    a.kv_store.flush()
    b = make(tiny_llama_dir, redis_url)
    _, other = run(b, ids, salt="tenant-2")
    c = make(tiny_llama_dir, redis_url)
    _, same = run(c, ids, salt="tenant-1")
    assert other == 0 and same > 0
    for e in (a, b, c):
        e.close()


def test_a_corrupted_entry_is_a_miss(tiny_llama_dir, redis_url):
    ids = prompt(4)
    a = make(tiny_llama_dir, redis_url)
    expect, _ = run(a, ids)
    a.kv_store.flush()
    r = redis.Redis.from_url(redis_url)
    b0 = make(tiny_llama_dir, redis_url)
    hashes = hash_chain(ids, BS, cache_extra(a.model_cfg.name))
    key = b0.kv_store.remote.key(b0.kv_store.tag, hashes[3])         # the 4th block: 3 are still good
    value = bytearray(r.get(key))
    value[len(value) // 2] ^= 0x01
    r.set(key, bytes(value))
    refused_once(b0, ids, expect, metrics.KV_STORE_INVALID)
    a.close()
    b0.close()


def test_a_forged_block_is_refused_counted_and_recomputed(tiny_llama_dir, redis_url):
    """Whoever can write to Redis, without the store key: a block of K/V of their own, in the right layout and with
    a recomputed checksum, or with a MAC under another key, is refused, counted, and the prefix computed again."""
    ids = prompt(14)
    a = make(tiny_llama_dir, redis_url, kv_store_key="store-key")
    expect, _ = run(a, ids)
    assert a.kv_store.flush()
    store = a.kv_store
    hashes = hash_chain(ids, BS, cache_extra(a.model_cfg.name))
    key = store.remote.key(store.tag, hashes[3])                     # the 4th block: 3 stay genuine
    r = redis.Redis.from_url(redis_url)
    genuine = decode(hashes[3], store.layout, r.get(key), store.key)
    steer = BlockData(torch.randn_like(genuine.kv.float()).to(genuine.kv.dtype), genuine.hidden)
    for forged in (encode(hashes[3], store.layout, steer), encode(hashes[3], store.layout, steer, b"k" * 32)):
        r.set(key, forged)
        b = make(tiny_llama_dir, redis_url, kv_store_key="store-key")
        refused_once(b, ids, expect, metrics.KV_STORE_FORGED)
        b.close()
    # the same store key reads the genuine value back (the check is not a blanket refusal)
    r.set(key, encode(hashes[3], store.layout, genuine, store.key))
    c = make(tiny_llama_dir, redis_url, kv_store_key="store-key")
    got, cached = run(c, ids)
    assert got == expect and cached > 3 * BS
    a.close()
    c.close()


def test_the_budget_evicts_least_recently_used(tiny_llama_dir, redis_url):
    probe = make(tiny_llama_dir, redis_url)
    per_block = probe.kv_store.layout.kv_bytes
    probe.close()
    a = make(tiny_llama_dir, redis_url, kv_store_gb=20.5 * per_block / 2**30)   # about 20 blocks' worth
    for seed in range(10, 14):                                       # 4 prompts x 10 full blocks
        run(a, prompt(seed), tokens=1)
        a.kv_store.flush()
    r = redis.Redis.from_url(redis_url)
    assert int(r.get("upesi:kv:bytes")) <= 20.5 * per_block
    assert 10 <= len(value_keys(redis_url)) <= 20
    b = make(tiny_llama_dir, redis_url)
    _, newest = run(b, prompt(13), tokens=1)
    _, oldest = run(b, prompt(10), tokens=1)
    assert newest == 40 and oldest == 0
    a.close()
    b.close()


def test_a_dead_store_only_costs_recomputation(tiny_llama_dir, redis_server):
    ids = prompt(5)
    a = make(tiny_llama_dir, redis_server.url)
    expect, _ = run(a, ids)
    a.kv_store.flush()
    redis_server.stop()
    b = make(tiny_llama_dir, redis_server.url)
    got, cached = run(b, ids)
    assert got == expect and cached == 0
    assert b.kv_store.flush()                     # the failed writes did not wedge the writer
    a.close()
    b.close()


def test_a_frozen_store_holds_one_lookup_once_and_is_read_again_when_it_answers(tiny_llama_dir, redis_server):
    """Redis stopped (SIGSTOP) answers nothing: one lookup waits its short read timeout, then no lookup touches the
    network while a background ping goes unanswered; once thawed the store is read again."""
    ids = prompt(15)
    a = make(tiny_llama_dir, redis_server.url)
    expect, _ = run(a, ids)
    assert a.kv_store.flush()
    b = make(tiny_llama_dir, redis_server.url)
    tier = b.kv_store.remote
    tier._retry_after_s = 0.2
    reads = []
    mget = tier._reader.mget
    tier._reader.mget = lambda keys: reads.append(len(keys)) or mget(keys)
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        got, cached = run(b, ids)
        assert got == expect and cached == 0 and len(reads) == 1       # the one read that timed out
        assert not tier._available()
        run(b, prompt(16))                                              # another prefix: no read tried
        assert len(reads) == 1
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    for _ in range(100):                                                # the probe's PING is answered
        if tier._available():
            break
        time.sleep(0.1)
    hashes = hash_chain(ids, BS, cache_extra(a.model_cfg.name))
    assert len(tier.get_leading(b.kv_store.tag, hashes)) == len(ids) // BS           # every prompt block
    a.close()
    b.close()


def test_host_tier_brings_back_evicted_blocks(tiny_llama_dir):
    ids, other = prompt(6), prompt(7, 100)
    ref, _ = run(make(tiny_llama_dir, blocks=32), ids)
    eng = make(tiny_llama_dir, host_gb=0.01, blocks=32)
    run(eng, ids)
    run(eng, other)                                # 28 blocks of 32: evicts 10 of the first request's 14
    hits = metrics.KV_STORE_HITS.labels("host")._value.get()
    got, cached = run(eng, ids)
    assert got == ref
    assert cached == (len(ids) - 1) // BS * BS
    assert metrics.KV_STORE_HITS.labels("host")._value.get() - hits >= 5     # its tail came back from the host
    assert eng.block_manager.num_used_blocks == 0


def test_the_disk_tier_survives_a_restart_and_refuses_a_damaged_file(tiny_llama_dir, tmp_path):
    ids = prompt(8)
    disk = tmp_path / "kv"
    a = make(tiny_llama_dir, kv_disk_dir=str(disk))
    expect, _ = run(a, ids)
    a.close()                                       # a restart: the writer finishes, the process state is gone
    files = sorted(disk.glob("*.kv"))
    assert len(files) == (len(ids) + len(expect) - 1) // BS
    hits = metrics.KV_STORE_HITS.labels("disk")._value.get()
    b = make(tiny_llama_dir, kv_disk_dir=str(disk))
    got, cached = run(b, ids)
    assert got == expect and cached == (len(ids) - 1) // BS * BS
    assert metrics.KV_STORE_HITS.labels("disk")._value.get() - hits == cached // BS
    b.close()
    damaged = b.kv_store.disk.path(hash_chain(ids, BS, cache_extra(b.model_cfg.name))[2])
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0x01
    damaged.write_bytes(bytes(raw))
    c = make(tiny_llama_dir, kv_disk_dir=str(disk))
    got, cached = run(c, ids)
    assert got == expect and cached == 2 * BS       # the damaged third block and what follows are computed
    assert not damaged.exists() or damaged.read_bytes() != bytes(raw)   # dropped, or written again correctly
    c.close()


def test_write_back_writes_blocks_as_they_leave_the_cache(tiny_llama_dir, tmp_path):
    """kv_store_write_policy write_back: nothing is written while a prompt is computed; blocks the cache evicts are
    written, and on a clean stop the ones it still holds, so a restarted target reads the whole prefix back."""
    ids, other = prompt(11), prompt(12, 100)
    disk = tmp_path / "kv"
    eng = make(tiny_llama_dir, blocks=32, kv_disk_dir=str(disk), kv_store_write_policy="write_back")
    expect, _ = run(eng, ids)
    eng.kv_store.flush()
    assert not list(disk.glob("*.kv"))                     # cached, so not written
    run(eng, other)                                        # 28 blocks of 32: evicts most of the first request's
    eng.kv_store.flush()
    chain = set(hash_chain(ids + expect, BS, cache_extra(eng.model_cfg.name)))
    written = {p for p in disk.glob("*.kv")}
    assert len(written) >= 5 and written <= {eng.kv_store.disk.path(h) for h in chain}
    eng.close()                                            # a clean stop: what the cache holds is written too
    assert len(list(disk.glob("*.kv"))) > len(written)
    b = make(tiny_llama_dir, kv_disk_dir=str(disk), kv_store_write_policy="write_back")
    got, cached = run(b, ids)
    assert got == expect and cached == (len(ids) - 1) // BS * BS
    b.close()
    with pytest.raises(ValueError, match="write_through"):
        EngineConfig(kv_store_write_policy="write_back", kv_store_sync=True)
    with pytest.raises(ValueError, match="write_back"):
        EngineConfig(kv_store_write_policy="sometimes")


def test_write_through_selective_writes_shared_and_evicted_blocks(tiny_llama_dir, tmp_path):
    """kv_store_write_policy write_through_selective: a prompt computed once is not written; the blocks a second
    request reads from the cache (a shared prefix) are, once; blocks the cache evicts are; a clean stop writes
    nothing more."""
    ids, other = prompt(13), prompt(14, 100)
    disk = tmp_path / "kv"
    eng = make(tiny_llama_dir, blocks=32, kv_disk_dir=str(disk), kv_store_write_policy="write_through_selective")
    expect, _ = run(eng, ids)
    eng.kv_store.flush()
    assert not list(disk.glob("*.kv"))
    got, cached = run(eng, ids)                            # the same prompt again: its prefix is shared
    eng.kv_store.flush()
    chain = hash_chain(ids, BS, cache_extra(eng.model_cfg.name))
    assert got == expect and cached == len(chain) * BS
    assert sorted(disk.glob("*.kv")) == sorted(eng.kv_store.disk.path(h) for h in chain)
    run(eng, ids)                                          # shared again: nothing new
    eng.kv_store.flush()
    assert len(list(disk.glob("*.kv"))) == len(chain)
    run(eng, other)                                        # evicts most of the first requests' blocks
    eng.kv_store.flush()
    evicted = len(list(disk.glob("*.kv")))
    assert evicted > len(chain)                            # their output blocks, never shared, came with eviction
    eng.close()
    assert len(list(disk.glob("*.kv"))) == evicted


def test_write_through_selective_waits_for_the_threshold(tiny_llama_dir, tmp_path):
    """kv_store_write_threshold 2: a block one later request shares is not written; the second sharer writes it."""
    ids = prompt(15)
    disk = tmp_path / "kv"
    eng = make(tiny_llama_dir, blocks=32, kv_disk_dir=str(disk), kv_store_write_policy="write_through_selective",
               kv_store_write_threshold=2)
    expect, _ = run(eng, ids)
    got, cached = run(eng, ids)                            # the first request to share the prefix: nothing yet
    eng.kv_store.flush()
    assert got == expect and cached > 0 and not list(disk.glob("*.kv"))
    run(eng, ids)                                          # the second: the shared blocks are written, once
    eng.kv_store.flush()
    chain = hash_chain(ids, BS, cache_extra(eng.model_cfg.name))
    assert sorted(disk.glob("*.kv")) == sorted(eng.kv_store.disk.path(h) for h in chain)
    run(eng, ids)
    eng.kv_store.flush()
    assert len(list(disk.glob("*.kv"))) == len(chain)
    eng.close()
    with pytest.raises(ValueError, match="kv_store_write_threshold"):
        EngineConfig(kv_store_write_policy="write_through_selective", kv_store_write_threshold=0)


def test_the_disk_tier_keeps_to_its_budget(tiny_llama_dir, tmp_path):
    from shared.kv.block_codec import BlockData, encode
    probe = make(tiny_llama_dir, kv_disk_dir=str(tmp_path / "probe"))
    layout = probe.kv_store.layout
    probe.close()
    size = len(encode(0, layout, BlockData(torch.zeros(layout.kv_shape, dtype=layout.dtype))))
    disk = tmp_path / "kv"
    eng = make(tiny_llama_dir, kv_disk_dir=str(disk), kv_disk_gb=3.5 * size / 2**30)   # room for 3 blocks
    ids = prompt(9)
    run(eng, ids, tokens=1)
    eng.close()
    newest = hash_chain(ids, BS, cache_extra(eng.model_cfg.name))[-3:]                 # written last: kept
    assert sorted(disk.glob("*.kv")) == sorted(eng.kv_store.disk.path(h) for h in newest)
    assert eng.kv_store.disk.used_bytes == 3 * size


def test_blocks_sent_to_another_target_give_the_same_logits(tiny_llama_dir):
    """P/D with direct transfer, the engines' part: the prefill engine's export, encoded and checked as PutBlocks
    carries it, lands in the decode engine's host tier; its run reads them and computes what an engine that had
    the prefix in its own cache computes, bit for bit. A damaged value is refused; a target without a host tier
    refuses blocks."""
    from services.target.block_transfer import encode_blocks, decode_blocks
    from shared.errors import NotConfigured

    ids = prompt(5)
    a = make(tiny_llama_dir)
    run(a, ids, tokens=1)                                              # the prefill target's job
    sent = a.export_blocks(ids)
    assert len(sent) == (len(ids) - 1) // BS
    values = encode_blocks(a.block_layout, sent)
    b = make(tiny_llama_dir, host_gb=0.01)
    damaged = values[-1][1][:-1] + bytes([values[-1][1][-1] ^ 1])
    good, bad = decode_blocks(b.block_layout, values[:-1] + [(values[-1][0], damaged)])
    assert (len(good), bad) == (len(values) - 1, 1)
    good, bad = decode_blocks(b.block_layout, values)
    assert bad == 0
    b.receive_blocks(good)
    b_logits = record_logits(b)
    got, cached_b = run(b, ids)
    assert cached_b == len(sent) * BS
    c = make(tiny_llama_dir)
    run(c, ids[:cached_b] + [7, 7, 7, 7, 7], tokens=1)                # the same prefix in C's own cache
    c_logits = record_logits(c)
    got_c, cached_c = run(c, ids)
    assert (got_c, cached_c) == (got, cached_b)
    assert len(b_logits) == len(c_logits) and all(torch.equal(x, y) for x, y in zip(b_logits, c_logits))
    with pytest.raises(NotConfigured):
        c.receive_blocks(good)
    for e in (a, b, c):
        e.close()


def test_a_full_disk_tier_leaves_redis_writes_going(tiny_llama_dir, redis_url, tmp_path):
    """A disk tier on a 64 KiB tmpfs fills up: its failed writes are counted and leave no temporary file, every
    block still reaches Redis, a replica reads them there, and temporary files left by a crash go at start."""
    import subprocess
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        (mnt / ".stale-0001.123.tmp").write_bytes(b"x")     # a write cut short by a crash, another tag's too
        ids = prompt(11, n=201)
        failures = metrics.KV_STORE_WRITE_FAILURES.labels("disk")._value.get()
        a = make(tiny_llama_dir, store=redis_url, kv_disk_dir=str(mnt))
        tag = a.kv_store.disk.tag
        (mnt / f".{tag}-00000000000000ab.1.tmp").write_bytes(b"half")
        expect, _ = run(a, ids)
        a.close()
        assert metrics.KV_STORE_WRITE_FAILURES.labels("disk")._value.get() > failures
        assert not list(mnt.glob(f".{tag}-*.tmp")) or list(mnt.glob(f".{tag}-*.tmp")) == [
            mnt / f".{tag}-00000000000000ab.1.tmp"]
        blocks = (len(ids) + len(expect) - 1) // BS
        assert len(list(mnt.glob("*.kv"))) < blocks <= len(value_keys(redis_url))
        b = make(tiny_llama_dir, store=redis_url)
        got, cached = run(b, ids)
        assert got == expect and cached == (len(ids) - 1) // BS * BS
        b.close()
        c = make(tiny_llama_dir, store=redis_url, kv_disk_dir=str(mnt))
        assert not list(mnt.glob(f".{tag}-*.tmp"))            # the crash's leftover went when the tier opened
        c.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
