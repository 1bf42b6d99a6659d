"""The target's side of `Target.Verify`: a draft service drives speculative decoding over one bidirectional stream.

    draft                                   target (this module)                      engine thread
      hello {wants_hidden}           ─►  VerifyLink
      open {request}                 ─►    bind request -> StreamProposer; Relay runs engine.generate
                                     ◄─    output {request_id, tokens}   (relayed by the draft to the router)
                                                                          step: propose(seqs of this stream)
                                     ◄─    propose {step, verdicts}     ◄── StreamProposer.propose (waits)
      proposals {step, K tokens, q}  ─►    answer(step)                  ──► drafts appended, verified next step
      abort {request_id}             ─►    engine.abort

A verdict is a DraftSequence delta: the draft keeps `base` tokens of what it saw and appends `tokens` (accepted
drafts plus the correction or bonus token), with the target's hidden states of accepted positions for proposers
that read them. If the stream breaks (the draft died), its requests go on without speculation; their output is kept
(`Relay.history`) for a caller that attaches (Generate with attach=True) within ORPHAN_S, else they are aborted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

import torch

from shared import telemetry, tensor_codec
from shared.engine.async_engine import AsyncEngine
from shared.engine.proposal import NO_PROPOSAL, Proposal
from shared.engine.sequence import Sequence
from shared.sampling_params import SamplingParams
from shared.spec.proposer_mux import ProposerMux
from shared.tree import MAX_TREE_NODES, check_tree, depths
from upesi.v1 import target_pb2

log = logging.getLogger("upesi.target.verify")

ORPHAN_S = 30.0          # how long the requests of a broken stream wait for a caller to attach
# A step waits for proposals at most WAIT_FACTOR times the draft's usual answer time (a moving average), and at least
# WAIT_FLOOR_S, once MEASURED answers have come (before that, the stream's whole timeout): a frozen draft then holds
# the engine thread, and every request on it, once and briefly
WAIT_FACTOR, WAIT_FLOOR_S, MEASURED = 10.0, 0.2, 3


class StreamProposer:
    """The proposer of one Verify stream's sequences, called on the engine thread: one exchange per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: asyncio.Queue, timeout_s: float,
                 vocab_size: int | None = None) -> None:
        self.loop, self.outbox, self.timeout_s = loop, outbox, timeout_s
        self.vocab_size = vocab_size              # proposals outside it are refused (None: not checked)
        self.wants_hidden = True                  # until the draft's hello says otherwise
        self.alive = True
        # the step the draft did not answer in time (frozen, overloaded): its sequences decode without drafts, and
        # no step waits for it again, until its late answer shows it is back
        self.unanswered: int | None = None
        self.sent: dict[int, int] = {}            # seq_id -> tokens the draft has (still valid ones counted)
        self.known: set[int] = set()              # seq_ids the draft may hold a mirror of (released at the end)
        self.hidden: dict[int, tuple[int, list[torch.Tensor]]] = {}   # seq_id -> (first position, [M, D] pieces)
        self.step = 0
        self.waiting: tuple[int, concurrent.futures.Future] | None = None
        self.answer_s: float | None = None        # the draft's answer time, moving average
        self.answers = 0

    def _send(self, msg: target_pb2.VerifyDown) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, msg)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return self.start_propose(seqs, ks)()

    def start_propose(self, seqs: list[Sequence], ks: list[int]) -> Callable[[], list[Proposal]]:
        """Sends this step's verdicts and returns a function that waits for the draft's proposals: the engine's
        mux sends to every stream first and then waits, so that the drafts of several streams work at once."""
        none: list[Proposal] = [NO_PROPOSAL] * len(seqs)
        if not self.alive or self.unanswered is not None:
            return lambda: none
        req = target_pb2.ProposeRequest()
        for s, k in zip(seqs, ks):
            base = min(self.sent.get(s.seq_id, 0), len(s.token_ids))
            p = s.params
            self.known.add(s.seq_id)
            msg = req.seqs.add(key=str(s.seq_id), base=base, tokens=s.token_ids[base:], k=k,
                               temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
            pending = self.hidden.pop(s.seq_id, None)
            if pending is not None:
                _, (msg.hidden_rows, msg.hidden_dim), msg.hidden = tensor_codec.encode(torch.cat(pending[1]).float())
                msg.hidden_start = pending[0]
        self.step += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.waiting = (self.step, fut)
        if not self.alive:                        # closed meanwhile: close() may not have seen `waiting`
            self.waiting = None
            return lambda: none
        self._send(target_pb2.VerifyDown(propose=req, step=self.step, traceparent=telemetry.traceparent()))
        t0 = time.perf_counter()
        return lambda: self._receive(seqs, ks, fut, t0)

    def wait_s(self) -> float:
        """How long a step waits for the draft's proposals (module constants)."""
        if self.answers < MEASURED or self.answer_s is None:
            return self.timeout_s
        return min(self.timeout_s, max(WAIT_FLOOR_S, WAIT_FACTOR * self.answer_s))

    def _receive(self, seqs: list[Sequence], ks: list[int], fut: concurrent.futures.Future,
                 t0: float) -> list[Proposal]:
        none: list[Proposal] = [NO_PROPOSAL] * len(seqs)
        wait = self.wait_s()
        try:
            resp: target_pb2.ProposeResponse | None = fut.result(timeout=max(0.0, wait - (time.perf_counter() - t0)))
        except concurrent.futures.TimeoutError:
            resp = None
        finally:
            self.waiting = None
        if resp is not None:
            took = time.perf_counter() - t0
            self.answers += 1
            self.answer_s = took if self.answer_s is None else self.answer_s + 0.1 * (took - self.answer_s)
        if resp is None or len(resp.proposals) != len(seqs):
            if self.alive:
                log.warning("the draft did not answer step %d in %.2f s; decoding without it until it does",
                            self.step, wait)
                self.unanswered = self.step
            self.sent.clear()                     # re-send whole sequences when it answers again
            self.hidden.clear()
            return none
        out = []
        for s, k, prop in zip(seqs, ks, resp.proposals):
            self.sent[s.seq_id] = len(s.token_ids)        # proposals beyond this are re-validated next time
            out.append(self._checked(prop, k))
        return out

    def _checked(self, prop: target_pb2.DraftProposal, k: int) -> Proposal:
        """A proposal as the engine may use it: at most k tokens in the vocab, q [len, V] if any; a malformed one
        (a misconfigured draft) is dropped, never allowed to fail the engine step."""
        tokens = list(prop.tokens) if prop.parents else list(prop.tokens)[:k]
        v = self.vocab_size
        try:
            q = tensor_codec.decode("float32", (len(prop.tokens), prop.vocab), prop.probs) if prop.probs else None
        except ValueError as e:
            log.warning("dropping a malformed proposal: %s", e)
            return NO_PROPOSAL
        if v is not None and (any(t >= v for t in tokens) or (q is not None and q.shape[-1] != v)):
            log.warning("dropping a proposal outside the target's vocab of %d", v)
            return NO_PROPOSAL
        if prop.parents:                              # a tree: k bounds its depth, MAX_TREE_NODES its size
            parents = list(prop.parents)
            try:
                check_tree(parents, len(tokens))
            except ValueError as e:
                log.warning("dropping a malformed draft tree: %s", e)
                return NO_PROPOSAL
            depth = max(depths(parents))
            if len(tokens) > MAX_TREE_NODES or depth > k:
                log.warning("dropping a draft tree of %d nodes and depth %d (at most %d nodes, depth %d)",
                            len(tokens), depth, MAX_TREE_NODES, k)
                return NO_PROPOSAL
            return Proposal(tokens, None, parents)
        return Proposal(tokens, q[:len(tokens)] if q is not None else None)

    def answer(self, step: int, resp: target_pb2.ProposeResponse) -> None:
        """The draft's proposals for `step` (on the event loop)."""
        if step == self.unanswered:               # late: the draft is back; the next step drafts again
            log.info("the draft answered step %d late; drafting again", step)
            self.unanswered = None
            return
        waiting = self.waiting
        if waiting is not None and waiting[0] == step and not waiting[1].done():
            waiting[1].set_result(resp)

    def close(self) -> None:
        """The stream ended: its sequences decode without speculation from now on."""
        self.alive = False
        waiting = self.waiting
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(None)

    def accept_hidden(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Keeps the target's hidden states [M, D] of positions start .. start + M - 1 for the next verdict."""
        if not self.wants_hidden or not self.alive:
            return
        first, pieces = self.hidden.get(seq.seq_id, (start, []))
        end = first + sum(len(x) for x in pieces)
        if start < first or start > end:             # recomputed from earlier, or a gap: send from here
            first, pieces = start, []
        elif start < end:                            # recomputed positions: keep what comes before them
            kept = torch.cat(pieces)[:start - first]
            pieces = [kept] if len(kept) else []
        self.hidden[seq.seq_id] = (first, pieces + [hidden.detach().clone()])

    def release(self, seq_id: int) -> None:
        """The sequence ended: the draft frees its mirror (a one-way message, no answer)."""
        self.hidden.pop(seq_id, None)
        self.sent.pop(seq_id, None)
        if seq_id in self.known and self.alive:
            self.known.discard(seq_id)
            self._send(target_pb2.VerifyDown(propose=target_pb2.ProposeRequest(released=[str(seq_id)]), step=0))


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
