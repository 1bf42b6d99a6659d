"""Integration fixtures. `redis_server`: a fresh, real redis-server per test on a free port (never 6379), which the test
may `stop()` and `restart()` on the same port; `redis_url` is its URL. `redis`: one such server per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.testing.redis_server import RedisServer


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


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()
