"""Several proposers behind the engine's one: each request's sequences go to the proposer bound to the request.

The target binds the requests a draft opened on a Verify stream to that stream's proposer; every other request
uses the engine's own (`--speculative`, or none). The engine calls the mux exactly as it calls one proposer.
"""
from __future__ import annotations

from shared.engine.proposers import Proposal, Proposer
from shared.engine.sequence import Sequence


class ProposerMux:
    def __init__(self, local: Proposer | None = None) -> None:
        self.local = local
        self.bound: dict[str, Proposer] = {}          # request id -> proposer (set by the caller's thread)

    def bind(self, request_id: str, proposer: Proposer) -> None:
        self.bound[request_id] = proposer

    def unbind(self, request_id: str) -> None:
        """The request goes on with the local proposer (or none) from its next step."""
        self.bound.pop(request_id, None)

    def _of(self, seq: Sequence) -> Proposer | None:
        return self.bound.get(seq.request_id, self.local)

    @property
    def wants_hidden(self) -> bool:
        return any(getattr(p, "wants_hidden", False) for p in {id(p): p for p in self._all()}.values())

    def _all(self) -> list[Proposer]:
        return ([self.local] if self.local is not None else []) + list(self.bound.values())

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out: list[Proposal] = [([], None)] * len(seqs)
        groups: dict[int, tuple[Proposer, list[int]]] = {}
        for i, s in enumerate(seqs):
            p = self._of(s)
            if p is not None:
                groups.setdefault(id(p), (p, []))[1].append(i)
        for p, idx in groups.values():                # one batched call per proposer
            for i, prop in zip(idx, p.propose([seqs[i] for i in idx], [ks[i] for i in idx])):
                out[i] = prop
        return out

    def accept_hidden(self, seq: Sequence, start: int, hidden) -> None:
        p = self._of(seq)
        if p is not None and getattr(p, "wants_hidden", False):
            p.accept_hidden(seq, start, hidden)

    def release(self, seq_id: int) -> None:
        """Every proposer may hold state for the sequence (a request can move from a stream to local)."""
        for p in {id(p): p for p in self._all()}.values():
            p.release(seq_id)
