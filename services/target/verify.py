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
that read them. If the stream breaks (the draft died), its requests go on without speculation (services.target.relays).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

import torch

from shared import telemetry, tensor_codec
from shared.engine.proposal import NO_PROPOSAL, Proposal
from shared.engine.sequence import Sequence
from shared.tree import MAX_TREE_NODES, check_tree, depths
from upesi.v1 import target_pb2

log = logging.getLogger("upesi.target.verify")

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
                               temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                               chain=not s.drafts_trees())
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
