"""The requests a draft service opens on a Verify stream, relayed between the engine and that stream.

Each request's output goes to its stream. If the stream breaks (the draft died), its requests go on without
speculation; their output is kept (`Relay.history`) for a caller that attaches (Generate with attach=True) within
ORPHAN_S, else they are aborted.
"""
from __future__ import annotations

import asyncio
import logging

from services.target.verify import StreamProposer
from shared import telemetry
from shared.engine.async_engine import AsyncEngine
from shared.sampling_params import SamplingParams
from shared.spec.proposer_mux import ProposerMux
from upesi.v1 import target_pb2

log = logging.getLogger("upesi.target.relays")

ORPHAN_S = 30.0          # how long the requests of a broken stream wait for a caller to attach


class Relay:
    """One request opened on a Verify stream: its output goes to the stream, or to a caller that attached."""

    def __init__(self, request_id: str, sink: asyncio.Queue | None) -> None:
        self.request_id = request_id
        self.sink = sink                              # where new messages go (None: nobody listens now)
        self.history: list[target_pb2.TargetGenerateResponse] = []
        self.done = False
        self.aborted = False                          # cancelled: its output stops short, nobody may attach
        self.task: asyncio.Task | None = None
        self.orphan_timer: asyncio.TimerHandle | None = None

    def push(self, msg: target_pb2.TargetGenerateResponse | BaseException | None) -> None:
        if isinstance(msg, target_pb2.TargetGenerateResponse):
            self.history.append(msg)
        if self.sink is not None:
            self.sink.put_nowait((self.request_id, msg))


def delta_to_pb(d, first: bool) -> target_pb2.TargetGenerateResponse:
    def pb(lps):
        return [target_pb2.TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs,
                                        rank=lp.rank) for lp in lps or ()]
    msg = target_pb2.TargetGenerateResponse(deltas=[target_pb2.TokenDelta(
        index=d.index, token_ids=d.token_ids, finish_reason=d.finish_reason or "",
        draft_tokens=d.num_draft_tokens, accepted_tokens=d.num_accepted_tokens, logprobs=pb(d.logprobs),
        prompt_logprobs=pb(d.prompt_logprobs), has_prompt_logprobs=d.prompt_logprobs is not None)])
    if first:
        msg.prompt_tokens, msg.cached_tokens = d.num_prompt_tokens, d.num_cached_tokens
    return msg


class Relays:
    """Every stream-opened request of this target, by id, until it ends (or its orphan time runs out)."""

    def __init__(self, engine: AsyncEngine, mux: ProposerMux) -> None:
        self.engine, self.mux = engine, mux
        self.by_id: dict[str, Relay] = {}

    def start(self, request_id: str, prompt: list[int], params: SamplingParams, proposer: StreamProposer,
              sink: asyncio.Queue, trace_ctx: str = "") -> Relay:
        """Runs the request with drafts from `proposer`; trace_ctx: the opener's W3C traceparent (or "")."""
        relay = self.by_id[request_id] = Relay(request_id, sink)
        self.mux.bind(request_id, proposer)
        relay.task = asyncio.get_running_loop().create_task(self._run(relay, prompt, params, trace_ctx))
        return relay

    async def _run(self, relay: Relay, prompt: list[int], params: SamplingParams, trace_ctx) -> None:
        first = True
        span, ctx = telemetry.request_span("/upesi.v1.Target/Verify open", trace_ctx)
        if ctx is not None:
            telemetry.attach(ctx)                      # this task's context: the engine's spans go under the span
        try:
            async for d in self.engine.generate(relay.request_id, prompt, params, relayed=True):
                relay.push(delta_to_pb(d, first))
                first = False
            relay.push(None)                                   # the end of the request
        except asyncio.CancelledError:
            relay.aborted = True
            raise
        except Exception as e:                                 # invalid request, engine failure: to the caller
            relay.push(e)
        finally:
            if span is not None:
                span.end()
            relay.done = True
            self.mux.unbind(relay.request_id)
            if relay.orphan_timer is not None:
                relay.orphan_timer.cancel()
                relay.orphan_timer = None
            self._forget_later(relay)

    def _forget_later(self, relay: Relay) -> None:
        """A finished request's output stays a little while, for a caller that attaches late."""
        asyncio.get_running_loop().call_later(ORPHAN_S, lambda: self.by_id.pop(relay.request_id, None)
                                              if self.by_id.get(relay.request_id) is relay else None)

    def abort(self, request_id: str, owner: asyncio.Queue | None = None) -> None:
        """Stops the request. owner: only if its output still goes there (a stream's abort must not stop a
        request that a caller has attached to meanwhile)."""
        relay = self.by_id.get(request_id)
        if relay is None or relay.task is None or (owner is not None and relay.sink is not owner):
            return
        relay.task.cancel()                                    # engine.generate's finally aborts the request

    def orphan(self, relays: list[Relay]) -> None:
        """Their stream broke: keep them running alone; abort those nobody attaches to within ORPHAN_S."""
        loop = asyncio.get_running_loop()
        for relay in relays:
            relay.sink = None
            self.mux.unbind(relay.request_id)
            if not relay.done:
                relay.orphan_timer = loop.call_later(ORPHAN_S, self._expire, relay)

    def _expire(self, relay: Relay) -> None:
        if relay.sink is None:
            log.info("request %s: no caller attached in %.0f s after its draft went away; aborting",
                     relay.request_id, ORPHAN_S)
            self.abort(relay.request_id)
            self.by_id.pop(relay.request_id, None)

    def attach(self, request_id: str) -> tuple[asyncio.Queue, list] | None:
        """A caller takes over the request: (its queue of (id, message | error | None), the output so far)."""
        relay = self.by_id.get(request_id)
        if relay is None or relay.aborted:
            return None
        if relay.orphan_timer is not None:
            relay.orphan_timer.cancel()
            relay.orphan_timer = None
        self.mux.unbind(request_id)                            # no more drafts from the stream that opened it
        queue: asyncio.Queue = asyncio.Queue()
        relay.sink = queue
        history = list(relay.history)
        if relay.done:
            queue.put_nowait((request_id, None))
        return queue, history
