"""The local-disk tier of the KV block store: encoded blocks as files in one directory, under a byte budget (LRU).

    {directory}/{tag}-{hash:016x}.kv     one value of shared.kv.block_codec (checked on every read)

The index is rebuilt from the directory when the tier opens, so a target restarted on the same machine finds the
blocks it wrote before. Files are written to a temporary name and renamed, so a reader never sees half a block;
a file that fails the codec's checks is deleted, a write that fails (a full disk) leaves no file behind, and
temporary files left by a process that died mid-write are removed when the tier opens. One writer (the store's
writer thread) and one reader (the engine thread) at a time.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from shared.kv.hashing import BlockHash

SUFFIX = ".kv"


class DiskTier:
    def __init__(self, directory: str | Path, budget_bytes: int, tag: str) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the disk tier needs a positive budget, got {budget_bytes} bytes")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes, self.tag = budget_bytes, tag
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()      # hash -> file size, oldest first
        for path in self.dir.glob(f".{tag}-*.tmp"):          # a write cut short by a crash
            path.unlink(missing_ok=True)
        found = []
        for path in self.dir.glob(f"{tag}-*{SUFFIX}"):
            try:
                st = path.stat()
                found.append((st.st_mtime_ns, BlockHash(int(path.stem.rsplit("-", 1)[1], 16)), st.st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(found):
            self._index[h] = size
            self.used_bytes += size
        self._evict()

    def __len__(self) -> int:
        return len(self._index)

    def path(self, h: BlockHash) -> Path:
        return self.dir / f"{self.tag}-{h:016x}{SUFFIX}"

    def get(self, h: BlockHash) -> bytes | None:
        with self._lock:
            if h not in self._index:
                return None
            self._index.move_to_end(h)
        try:
            return self.path(h).read_bytes()
        except OSError:
            self.drop(h)
            return None

    def put(self, h: BlockHash, value: bytes) -> None:
        if len(value) > self.budget_bytes:
            return
        tmp = self.dir / f".{self.tag}-{h:016x}.{threading.get_ident()}.tmp"
        try:
            tmp.write_bytes(value)
            os.replace(tmp, self.path(h))
        except OSError:                                       # a full disk, say: no half-written file stays
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self.used_bytes += len(value) - self._index.pop(h, 0)
            self._index[h] = len(value)
        self._evict()

    def drop(self, h: BlockHash) -> None:
        with self._lock:
            size = self._index.pop(h, None)
            if size is None:
                return
            self.used_bytes -= size
        self.path(h).unlink(missing_ok=True)

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.used_bytes <= self.budget_bytes or not self._index:
                    return
                h, size = self._index.popitem(last=False)
                self.used_bytes -= size
            self.path(h).unlink(missing_ok=True)
