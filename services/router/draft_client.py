"""The router's view of a draft replica: speculative requests go through it, and survive it.

`generate` asks the draft to run the request with a named target (the draft drives the Verify stream, see
protos/upesi/v1/draft.proto). If the draft fails (UNAVAILABLE: it died, or cannot reach the target; or
PERMISSION_DENIED: the target is not on its --targets; or stalls: nothing for PROBE_AFTER_S and its health check
unanswered within PROBE_S, as when it is frozen; or, answering, nothing for `stall_s` once answers flow,
`first_stall_s` before the first), the router attaches to the request on the target itself,
which has been going on without speculation; the target replays the request's output from its first token, and the
tokens the client already has are skipped. The client sees one uninterrupted stream. If the target does not run the
request (the draft never opened it), it starts there afresh when the client has nothing yet, and fails with
UNAVAILABLE otherwise (two runs are never spliced). If the target is gone too, the client gets UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.target_client import StepOutput, TargetClient, read_steps, target_request
from shared.errors import PeerUnavailable
from shared.rpc.channel import aio_channel, keepalive_options
from shared.sampling_params import SamplingParams
from upesi.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("upesi.router.draft")


PROBE_AFTER_S = 0.5       # a stream silent this long has its draft's health checked (and again as often) ...
PROBE_S = 0.5             # ... which must answer within this


class Stalled(Exception):
    """The draft sent nothing for longer than the stall limit, or went silent and did not answer its health check."""


async def _unstalled(steps: AsyncIterator[StepOutput], first_s: float, next_s: float,
                     alive: Callable[[], Awaitable[bool]]) -> AsyncIterator[StepOutput]:
    """steps, raising Stalled when the first does not come within first_s or a later one within next_s, or when
    `alive()` says no after PROBE_AFTER_S of silence (then every PROBE_AFTER_S)."""
    limit = first_s
    while True:
        nxt = asyncio.ensure_future(anext(steps))
        waited = 0.0
        try:
            while not nxt.done():
                wait = min(PROBE_AFTER_S, limit - waited)
                await asyncio.wait({nxt}, timeout=wait)
                waited += wait
                if not nxt.done() and (waited >= limit or not await alive()):
                    raise Stalled
            out = nxt.result()
        except StopAsyncIteration:
            return
        finally:
            if not nxt.done():
                nxt.cancel()
                await asyncio.wait({nxt})             # the stream's generator is free again for aclose()
        limit = next_s
        yield out


class DraftClient:
    def __init__(self, address: str, retry_after_s: float = 5.0, stall_s: float = 15.0,
                 first_stall_s: float = 60.0) -> None:
        self.address, self.retry_after_s = address, retry_after_s
        self.stall_s, self.first_stall_s = stall_s, first_stall_s
        self.channel = aio_channel(address, options=keepalive_options())
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.in_flight = 0
        self.down_until = 0.0                 # after a failure, requests skip this draft for retry_after_s

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    async def generate(self, target: TargetClient, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout: float | None) -> AsyncIterator[StepOutput]:
        deadline = None if timeout is None else time.monotonic() + timeout
        have: dict[int, int] = {}                         # choice -> tokens the caller already got
        self.in_flight += 1
        try:
            call = self.stub.Generate(draft_pb2.DraftGenerateRequest(
                target=target.address, request=target_request(request_id, prompt, params)), timeout=timeout)
            steps = read_steps(call, params.n)
            try:
                async for out in _unstalled(steps, self.first_stall_s, self.stall_s, self.alive):
                    for index, tokens, *_ in out.deltas:
                        have[index] = have.get(index, 0) + len(tokens)
                    yield out
            finally:
                await steps.aclose()                          # cancels the call
            return
        except Stalled:
            self.down_until = time.monotonic() + self.retry_after_s
            log.warning("draft %s went silent (frozen?); %s goes on with target %s alone", self.address,
                        request_id, target.address)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:       # not one of the draft's --targets
                log.warning("draft %s refuses target %s (%s); %s runs there without speculation", self.address,
                            target.address, e.details(), request_id)
            elif e.code() == grpc.StatusCode.UNAVAILABLE:
                self.down_until = time.monotonic() + self.retry_after_s
                log.warning("draft %s failed mid-request (%s); %s goes on with target %s alone", self.address,
                            e.details() or e.code().name, request_id, target.address)
            else:
                raise
        finally:
            self.in_flight -= 1
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            async for out in self._attach(target, request_id, prompt, params, left, dict(have)):
                yield out
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            if any(have.values()):
                raise PeerUnavailable(f"the draft {self.address} failed and the target {target.address} no longer "
                                      "runs the request; retry it") from None
            async for out in target.generate(request_id, prompt, params, left):
                yield out

    async def alive(self) -> bool:
        """Whether the draft answers its health check within PROBE_S."""
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_S)
            return True
        except grpc.aio.AioRpcError:
            return False

    @staticmethod
    async def _attach(target: TargetClient, request_id: str, prompt: list[int], params: SamplingParams,
                      timeout: float | None, have: dict[int, int]) -> AsyncIterator[StepOutput]:
        """The target's replay of the request from its first token, less what the caller already has."""
        async for out in target.generate(request_id, prompt, params, timeout, attach=True):
            deltas = []
            for index, tokens, reason, lps, prompt in out.deltas:
                skip = min(have.get(index, 0), len(tokens))
                have[index] = have.get(index, 0) - skip
                deltas.append((index, tokens[skip:], reason, None if lps is None else lps[skip:],
                               None if skip else prompt))
            out.deltas = deltas
            yield out

    async def close(self) -> None:
        await self.channel.close()
