"""The target's client of a draft service: a Proposer whose proposals come over gRPC (one call per step).

Sends only deltas (see protos/upesi/v1/draft.proto). When the draft cannot be reached the step simply runs
without speculation, and the draft's mirrors are re-sent in full once it answers again.
"""
from __future__ import annotations

import logging
import time

import grpc

from services.draft.servicer import probs_from_pb
from shared.engine.proposers import Proposal
from shared.engine.sequence import Sequence
from upesi.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("upesi.target.draft")


class RemoteProposer:
    def __init__(self, address: str, timeout_s: float = 2.0, retry_after_s: float = 5.0) -> None:
        self.address, self.timeout_s, self.retry_after_s = address, timeout_s, retry_after_s
        self.channel = grpc.insecure_channel(address)
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.sent: dict[int, int] = {}            # seq_id -> tokens the draft has (still valid ones counted)
        self.released: list[str] = []
        self.down_until = 0.0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        if time.monotonic() < self.down_until:
            return [([], None)] * len(seqs)
        req = draft_pb2.ProposeRequest(released=self.released)
        for s, k in zip(seqs, ks):
            base = min(self.sent.get(s.seq_id, 0), len(s.token_ids))
            p = s.params
            req.seqs.add(key=str(s.seq_id), base=base, tokens=s.token_ids[base:], k=k, temperature=p.temperature,
                         top_p=p.top_p, top_k=p.top_k, seed=p.seed)
        try:
            resp = self.stub.Propose(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            log.warning("draft %s unreachable (%s); decoding without speculation for %.0f s", self.address,
                        e.code().name, self.retry_after_s)
            self.down_until = time.monotonic() + self.retry_after_s
            self.sent.clear()                    # the draft may come back empty: send whole sequences then
            return [([], None)] * len(seqs)
        self.released = []
        out = []
        for s, prop in zip(seqs, resp.proposals):
            self.sent[s.seq_id] = len(s.token_ids)          # proposals beyond this are re-validated next time
            out.append((list(prop.tokens), probs_from_pb(prop)))
        return out

    def release(self, seq_id: int) -> None:
        if self.sent.pop(seq_id, None) is not None:
            self.released.append(str(seq_id))
