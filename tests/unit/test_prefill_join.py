"""The router's optional replicas (prefill targets): down until they answer Info, so a router whose prefill target
is not deployed (compose without the `pd` profile, a Kubernetes Deployment of 0 pods) starts and serves without it."""
from __future__ import annotations

import asyncio

from services.router.target_client import TargetClient, TargetInfo
from shared.testing.stack import free_port


def test_a_prefill_target_that_never_answers_stays_down():
    async def go() -> None:
        client = TargetClient(f"127.0.0.1:{free_port()}")          # nothing listens there
        assert client.up
        join = asyncio.create_task(client.join_when_up(TargetInfo("m", 2048, 100, [2], 16)))
        await asyncio.sleep(0.5)
        assert not client.up and not join.done()                 # still waiting, and skipped meanwhile
        join.cancel()
        await client.close()
    asyncio.run(go())
