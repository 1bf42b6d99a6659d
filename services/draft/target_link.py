"""The draft's side of `Target.Verify`: one bidirectional stream per target, shared by every request sent there.

`TargetLinks.get(address)` opens the stream on first use (and again after it broke). `TargetLink.generate` opens
a request on it and yields the target's output for that request; meanwhile the link answers each of the target's
`propose` messages (one per engine step, carrying the verdicts of all this stream's sequences) with proposals from
the local proposer (DraftState), batched the same way. Protobuf stays in services/; DraftState never sees it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from services.draft import metrics
from services.draft.codec import deltas_from_pb, proposals_to_pb
from services.draft.proposer_service import DraftState
from shared import telemetry
from shared.engine.proposal import NO_PROPOSAL
from shared.errors import PeerUnavailable
from shared.rpc.channel import aio_channel, keepalive_options
from shared.rpc.errors import Relayed
from upesi.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("upesi.draft.link")


class TargetLink:
    def __init__(self, address: str, state: DraftState) -> None:
        self.address, self.state = address, state
        self.channel = aio_channel(address, options=keepalive_options())
        self.outbox: asyncio.Queue = asyncio.Queue()                     # VerifyUp messages
        self.requests: dict[str, asyncio.Queue] = {}                     # request id -> its output
        self.keys: set[str] = set()                                      # sequences this stream mirrors
        self.closed = False
        self.call = target_pb2_grpc.TargetStub(self.channel).Verify(self._up())
        self.outbox.put_nowait(target_pb2.VerifyUp(hello=target_pb2.VerifyHello(wants_hidden=state.wants_hidden)))
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _up(self):
        while True:
            msg = await self.outbox.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        err: BaseException = PeerUnavailable(f"the target {self.address} closed the verify stream")
        try:
            async for down in self.call:
                kind = down.WhichOneof("kind")
                if kind == "propose":
                    if down.step == 0:                                   # releases only
                        self._release([self._key(k) for k in down.propose.released])
                    else:
                        await self._answer(down)
                elif kind == "output":
                    q = self.requests.get(down.request_id)
                    if q is not None:
                        q.put_nowait(down.output)
                elif kind == "error":
                    q = self.requests.get(down.request_id)
                    if q is not None:
                        q.put_nowait(Relayed(_status(down.error_code), down.error))
        except grpc.aio.AioRpcError as e:
            err = PeerUnavailable(f"the target {self.address} is unreachable: {e.details() or e.code().name}")
        except asyncio.CancelledError:
            raise
        except Exception as e:                                          # never leave callers waiting
            log.exception("verify stream to %s failed", self.address)
            err = PeerUnavailable(f"the verify stream to {self.address} failed: {e}")
        finally:
            self.closed = True
            for q in self.requests.values():
                q.put_nowait(err)
            self._release(list(self.keys))                            # the target forgets them too

    async def _answer(self, down: target_pb2.VerifyDown) -> None:
        """One target step's verdicts -> the next proposals (computed here, on the loop's thread). A step that
        fails here is answered with no proposals (those sequences decode one token), never by ending the stream."""
        released = [self._key(k) for k in down.propose.released]
        try:
            deltas = deltas_from_pb(down.propose)
            for d in deltas:
                d.key = self._key(d.key)
            self.keys.update(d.key for d in deltas)
            with telemetry.span_from("draft propose", down.traceparent, {"upesi.seqs": len(deltas)}):
                proposals = metrics.propose(self.state, deltas, released)     # inline: see services/draft/main.py
        except Exception:
            log.exception("proposing for %d sequences of %s failed; answering with none", len(down.propose.seqs),
                          self.address)
            proposals = [NO_PROPOSAL] * len(down.propose.seqs)
        self.keys.difference_update(released)
        self.outbox.put_nowait(target_pb2.VerifyUp(step=down.step, proposals=proposals_to_pb(
            proposals, self.state.wants_hidden)))

    def _key(self, seq_key: str) -> str:
        """The target's sequence id, made unique among all targets this draft serves (one DraftState for all)."""
        return f"{self.address}#{seq_key}"

    def _release(self, keys: list[str]) -> None:
        if keys:
            self.keys.difference_update(keys)
            metrics.release(self.state, keys)

    async def generate(self, request: target_pb2.TargetGenerateRequest
                       ) -> AsyncIterator[target_pb2.TargetGenerateResponse]:
        """Opens `request` on the stream and yields its output until every choice has finished."""
        rid = request.request_id
        if self.closed:
            raise PeerUnavailable(f"the verify stream to {self.address} is closed")
        if rid in self.requests:
            raise Relayed(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already running")
        q: asyncio.Queue = asyncio.Queue()
        self.requests[rid] = q
        self.outbox.put_nowait(target_pb2.VerifyUp(open=request, traceparent=telemetry.traceparent()))
        remaining = request.n or 1
        try:
            while remaining > 0:
                item = await q.get()
                if isinstance(item, BaseException):
                    remaining = 0                       # the target ended it (or is gone): nothing to abort
                    raise item
                remaining -= sum(1 for d in item.deltas if d.finish_reason)
                yield item
        finally:
            del self.requests[rid]
            if remaining > 0 and not self.closed:       # the caller went away: stop it on the target
                self.outbox.put_nowait(target_pb2.VerifyUp(abort=target_pb2.AbortRequest(request_id=rid)))

    async def close(self) -> None:
        self.outbox.put_nowait(None)
        self.reader.cancel()
        await self.channel.close()


def _status(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of an integer code (UNKNOWN for one it does not know)."""
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)


class TargetLinks:
    """The open streams of this draft, by target address."""

    def __init__(self, state: DraftState) -> None:
        self.state = state
        self.links: dict[str, TargetLink] = {}

    def get(self, address: str) -> TargetLink:
        link = self.links.get(address)
        if link is None or link.closed:
            if link is not None:
                asyncio.get_running_loop().create_task(link.close())
            link = self.links[address] = TargetLink(address, self.state)
        return link

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
