"""The engine's KV blocks beyond its cache: the block store (evictions out, hits in, filled blocks written) and
blocks sent to or received from other targets (prefill / decode disaggregation, direct transfer)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import NotConfigured
from shared.kv.block_codec import BlockData
from shared.kv.block_store import KVBlockStore, open_block_store
from shared.kv.hashing import BlockHash, hash_chain

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig


class KVTransferMixin:
    """Part of LLMEngine (shared.engine.engine): reads its block manager, runner and block store."""

    def _open_kv_store(self, cfg: EngineConfig) -> KVBlockStore | None:
        """The block store the config asks for (None: none), wired to the block manager."""
        store = open_block_store(self.block_layout, cfg.kv_store, cfg.kv_store_gb, cfg.kv_store_ttl_s,
                                 cfg.kv_host_gb, cfg.kv_disk_dir, cfg.kv_disk_gb, cfg.kv_store_write_policy,
                                 cfg.kv_store_write_threshold, cfg.kv_store_key)
        if store is not None:
            bm = self.block_manager
            bm.source = store
            bm.track_evictions, bm.track_commits, bm.track_reuse = (store.wants_evictions, store.wants_commits,
                                                                    store.wants_reuse)
        return store

    def _sync_blocks(self) -> None:
        """Before a forward pass writes the cache: evicted blocks out to the store, copy-on-write copies, blocks
        read from the store in."""
        work = self.block_manager.take_cache_work()
        if work.evictions:
            blocks = [b for b, _ in work.evictions]
            self.kv_store.evicted([(h, BlockData(kv.clone(), None if hid is None else hid.clone()))
                                   for (_, h), (kv, hid) in zip(work.evictions, self.runner.read_blocks(blocks))])
        self.runner.copy_blocks(work.copies)
        if work.imports:
            self.runner.write_blocks([b for b, _ in work.imports], [(d.kv, d.hidden) for _, d in work.imports])

    def _store_commits(self) -> None:
        """Blocks this step filled, or (write_through_selective) that a new sequence matched in the cache and the
        store does not have yet: copied out for the store's writer (the step does not wait for the write)."""
        reuses, commits = self.block_manager.take_store_work()
        if reuses:
            fresh = {h: b for b, h in reuses if self.kv_store.count_match(h)}      # hash -> block, once
            if fresh:
                read = self.runner.read_blocks(list(fresh.values()))
                self.kv_store.reused([(h, BlockData(kv, hid)) for h, (kv, hid) in zip(fresh, read)])
        if commits:
            read = self.runner.read_blocks([b for b, _ in commits])
            self.kv_store.committed([(h, BlockData(kv, hid)) for (_, h), (kv, hid) in zip(commits, read)])
            if self.cfg.kv_store_sync:
                self.kv_store.flush()

    def export_blocks(self, prompt: list[int], cache_salt: str = "") -> list[tuple[BlockHash, BlockData]]:
        """Copies of the KV of `prompt`'s leading full blocks that this cache holds, in order, up to the first it
        does not: what a decode target needs to skip the prefill this engine computed (the last prompt token is
        always computed there, so its block is not included when it is full)."""
        bm = self.block_manager
        hashes = hash_chain(prompt, bm.block_size, self._cache_extra(prompt, cache_salt),
                            max_blocks=(len(prompt) - 1) // bm.block_size)
        blocks = []
        for h in hashes:
            block = bm.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        read = self.runner.read_blocks(blocks) if blocks else []
        return [(h, BlockData(kv, hid)) for h, (kv, hid) in zip(hashes, read)]

    def receive_blocks(self, items: list[tuple[BlockHash, BlockData]]) -> None:
        """Blocks another target computed (already checked against this engine's layout) into the host tier, where
        the next prefix-cache miss of their prompt finds them."""
        if self.kv_store is None or self.kv_store.host is None:
            raise NotConfigured("this target keeps no host tier for KV blocks from other targets: start it with "
                                "--kv-host-gb")
        self.kv_store.received(items)

    def close(self) -> None:
        """Stops background work (the block store's writer, after its queued writes). With write_back, the blocks
        the cache still holds are written first."""
        if self.kv_store is None:
            return
        if self.kv_store.wants_cache_at_stop:
            held = list(self.block_manager.cached.items())                    # (hash, block)
            for i in range(0, len(held), 64):
                part = held[i:i + 64]
                read = self.runner.read_blocks([b for _, b in part])
                self.kv_store.stopping([(h, BlockData(kv, hid)) for (h, _), (kv, hid) in zip(part, read)])
        self.kv_store.close()
