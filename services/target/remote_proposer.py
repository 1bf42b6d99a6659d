"""The target's client of a draft service: a Proposer whose proposals come over gRPC (one call per step).

Sends only deltas (see protos/upesi/v1/draft.proto). When the draft cannot be reached the step simply runs
without speculation, and the draft's mirrors are re-sent in full once it answers again.
Hidden states for an eagle draft: the engine hands them over after every step (`accept_hidden`); they wait here
and go with the sequence's next Propose call. Until the draft's first answer says whether it reads them they are
kept, afterwards only if it does. After an outage the draft's head starts again from the positions sent next.
"""
from __future__ import annotations

import logging
import time

import grpc

import torch

from services.draft.servicer import hidden_to_pb, probs_from_pb
from shared.engine.proposers import Proposal
from shared.engine.sequence import Sequence
from shared.rpc.channel import sync_channel
from upesi.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("upesi.target.draft")


class RemoteProposer:
    def __init__(self, address: str, timeout_s: float = 2.0, retry_after_s: float = 5.0) -> None:
        self.address, self.timeout_s, self.retry_after_s = address, timeout_s, retry_after_s
        self.channel = sync_channel(address)             # TLS and tracing as this service is set up
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.sent: dict[int, int] = {}            # seq_id -> tokens the draft has (still valid ones counted)
        self.released: list[str] = []
        self.down_until = 0.0
        self.wants_hidden = True                  # until the draft says otherwise
        self.hidden: dict[int, tuple[int, list[torch.Tensor]]] = {}   # seq_id -> (first position, [M, D] pieces)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        if time.monotonic() < self.down_until:
            return [([], None)] * len(seqs)
        req = draft_pb2.ProposeRequest(released=self.released)
        for s, k in zip(seqs, ks):
            base = min(self.sent.get(s.seq_id, 0), len(s.token_ids))
            p = s.params
            msg = req.seqs.add(key=str(s.seq_id), base=base, tokens=s.token_ids[base:], k=k,
                               temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
            pending = self.hidden.pop(s.seq_id, None)
            if pending is not None:
                msg.hidden, msg.hidden_rows, msg.hidden_dim = hidden_to_pb(torch.cat(pending[1]))
                msg.hidden_start = pending[0]
        try:
            resp = self.stub.Propose(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            log.warning("draft %s unreachable (%s); decoding without speculation for %.0f s", self.address,
                        e.code().name, self.retry_after_s)
            self.down_until = time.monotonic() + self.retry_after_s
            self.sent.clear()                    # the draft may come back empty: send whole sequences then
            self.hidden.clear()
            return [([], None)] * len(seqs)
        self.released = []
        self.wants_hidden = resp.wants_hidden
        if not self.wants_hidden:
            self.hidden.clear()
        out = []
        for s, prop in zip(seqs, resp.proposals):
            self.sent[s.seq_id] = len(s.token_ids)          # proposals beyond this are re-validated next time
            out.append((list(prop.tokens), probs_from_pb(prop)))
        return out

    def accept_hidden(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Keeps the target's hidden states [M, D] of positions start .. start + M - 1 for the next call."""
        first, pieces = self.hidden.get(seq.seq_id, (start, []))
        end = first + sum(len(x) for x in pieces)
        if start < first or start > end:             # recomputed from earlier, or a gap: send from here
            first, pieces = start, []
        elif start < end:                            # recomputed positions: keep what comes before them
            kept = torch.cat(pieces)[:start - first]
            pieces = [kept] if len(kept) else []
        self.hidden[seq.seq_id] = (first, pieces + [hidden.detach().clone()])

    def release(self, seq_id: int) -> None:
        """Releases ride on the next Propose call; when no speculating sequence is left there is none, so they go
        at once (a small call, once per idle moment), and the draft never holds state for finished sequences."""
        self.hidden.pop(seq_id, None)
        if self.sent.pop(seq_id, None) is not None:
            self.released.append(str(seq_id))
        if self.released and not self.sent and time.monotonic() >= self.down_until:
            try:
                self.stub.Propose(draft_pb2.ProposeRequest(released=self.released), timeout=self.timeout_s)
                self.released = []
            except grpc.RpcError:
                pass                                 # kept for the next call; a restarted draft holds nothing anyway
