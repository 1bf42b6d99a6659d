"""A load run against the shared stack: 64 concurrent streaming requests for 2 minutes (UPESI_LOAD_SECONDS changes
the length), zero errors, and every KV block back in the free pool afterwards."""
from __future__ import annotations

import asyncio
import os

import pytest

from shared.testing.load_run import run_load

pytestmark = pytest.mark.slow


def test_64_concurrent_streams_for_two_minutes(stack):
    seconds = float(os.environ.get("UPESI_LOAD_SECONDS", "120"))
    result = asyncio.run(run_load(stack.address, concurrency=64, duration_s=seconds, min_tokens=8, max_tokens=48,
                                  metrics_url=f"http://127.0.0.1:{stack.metrics_port}/metrics"))
    print(result.summary())
    assert not result.errors, result.summary()
    assert result.requests >= 64 and result.tokens > 0          # every worker finished at least one request
    assert result.kv_blocks_used_after == 0, result.summary()
