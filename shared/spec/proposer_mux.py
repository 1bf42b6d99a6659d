"""Several proposers behind the engine's one: each request's sequences go to the proposer bound to the request.

The target binds the requests a draft opened on a Verify stream to that stream's proposer; every other request
uses the engine's own (`--speculative`, or none). The engine calls the mux exactly as it calls one proposer.

Lookup first for the streams' sequences: one whose text repeats its context is drafted here by prompt lookup
(shared.spec.lookup) and left out of that step's exchange with its draft service, which saves the round trip and
the draft's work where a lookup chain is the better draft anyway. Its hidden states and tokens wait in the stream's
proposer and reach the draft with its next exchange.

With `lookup_unbound` (the target's `--lookup-speculation`), requests that have no proposer at all (the router sent
them without a draft service: its guard or the load kept them from one) are drafted by the same lookup: a text that
repeats its context still gets chains, with no draft service involved. A request that asks for no speculation
(num_speculative_tokens 0) never reaches the proposer. `propose_lookup` drafts by lookup alone: the steps the
target's speculation guard keeps from the draft services.
"""
from __future__ import annotations

from collections.abc import Callable

from shared.engine.proposal import NO_PROPOSAL, Proposal, Proposer
from shared.engine.sequence import Sequence
from shared.spec.lookup import LOOKUP_N, LookupFirst


class ProposerMux:
    def __init__(self, local: Proposer | None = None, lookup_n: int = LOOKUP_N, lookup_unbound: bool = False) -> None:
        self.local = local
        self.lookup = LookupFirst(lookup_n)           # for sequences bound to a stream (0: off) ...
        self.lookup_unbound = lookup_unbound and lookup_n > 0    # ... and for those without a proposer
        self.bound: dict[str, Proposer] = {}          # request id -> proposer (set by the caller's thread)
        self.streams: dict[int, Proposer] = {}        # every live stream's proposer, bound requests or not

    def add(self, proposer: Proposer) -> None:
        """A proposer that requests may be bound to (a Verify stream's), until `remove`."""
        self.streams[id(proposer)] = proposer

    def remove(self, proposer: Proposer) -> None:
        self.streams.pop(id(proposer), None)

    @property
    def active(self) -> bool:
        """Whether any request can get drafts (else the engine skips proposing)."""
        return self.local is not None or bool(self.bound) or self.lookup_unbound

    def bind(self, request_id: str, proposer: Proposer) -> None:
        self.bound[request_id] = proposer

    def unbind(self, request_id: str) -> None:
        """The request goes on with the local proposer (or none) from its next step."""
        self.bound.pop(request_id, None)

    def _of(self, seq: Sequence) -> Proposer | None:
        return self.bound.get(seq.request_id, self.local)

    @property
    def wants_hidden(self) -> bool:
        local = [self.local] if self.local is not None else []
        return any(getattr(p, "wants_hidden", False) for p in local + list(self.bound.values()))

    def _all(self) -> list[Proposer]:
        return ([self.local] if self.local is not None else []) + list(self.streams.values())

    def _looks_up(self, p: Proposer | None) -> bool:
        """Whether lookup first serves a sequence whose proposer is `p`: a stream's, or none with lookup_unbound."""
        return hasattr(p, "start_propose") or (p is None and self.lookup_unbound)

    def _lookup(self, seqs: list[Sequence], ks: list[int], proposers: list[Proposer | None],
                out: list[Proposal]) -> set[int]:
        """Lookup chains into `out` for the sequences lookup first serves -> the indices it drafted."""
        served = [i for i, p in enumerate(proposers) if self._looks_up(p)]
        chains = self.lookup.chains([seqs[i] for i in served], [ks[i] for i in served])
        for j, chain in chains.items():
            out[served[j]] = Proposal(chain)
        return {served[j] for j in chains}

    def propose_lookup(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Prompt lookup's chains alone, no draft service or local proposer asked: a step the speculation guard
        keeps from the draft still drafts the text that repeats (shared.engine.speculation)."""
        out: list[Proposal] = [NO_PROPOSAL] * len(seqs)
        self._lookup(seqs, ks, [self._of(s) for s in seqs], out)
        return out

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out: list[Proposal] = [NO_PROPOSAL] * len(seqs)
        proposers = [self._of(s) for s in seqs]
        looked_up = self._lookup(seqs, ks, proposers, out)
        groups: dict[int, tuple[Proposer, list[int]]] = {}
        for i, p in enumerate(proposers):
            if p is not None and i not in looked_up:
                groups.setdefault(id(p), (p, []))[1].append(i)
        # One batched call per proposer. Remote ones (Verify streams) are sent their verdicts first and awaited
        # after, so that every draft service and the local proposer compute at the same time.
        remote: list[tuple[list[int], Callable[[], list[Proposal]]]] = []
        local: list[tuple[list[int], Callable[[], list[Proposal]]]] = []
        for p, idx in groups.values():
            args = [seqs[i] for i in idx], [ks[i] for i in idx]
            start = getattr(p, "start_propose", None)
            if start is None:
                local.append((idx, lambda p=p, args=args: p.propose(*args)))
            else:
                remote.append((idx, start(*args)))
        for idx, wait in local + remote:
            for i, prop in zip(idx, wait()):
                out[i] = prop
        return out

    def accept_hidden(self, seq: Sequence, start: int, hidden) -> None:
        p = self._of(seq)
        if p is not None and getattr(p, "wants_hidden", False):
            p.accept_hidden(seq, start, hidden)

    def release(self, seq_id: int) -> None:
        """Every proposer may hold state for the sequence: the request may have been unbound already (it ended on
        the caller's side first, or moved from a stream to local)."""
        for p in self._all():
            p.release(seq_id)
        self.lookup.release(seq_id)
