"""Integration fixtures. `redis_server`: a fresh, real redis-server per test on a free port (never 6379), which the test
may `stop()` and `restart()` on the same port; `redis_url` is its URL."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])  # tests/, home of the redis_server helper
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from redis_server import RedisServer  # noqa: E402 - needs the sys.path entry above


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
