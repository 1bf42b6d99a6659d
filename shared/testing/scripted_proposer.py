"""A proposer whose drafts a test scripts: all right (the plain greedy continuation) or all wrong, recording the K
the engine asks for (adaptive K, wide threads)."""
from __future__ import annotations

from shared.engine.proposal import Proposal
from shared.engine.sequence import Sequence

PROMPT = [3, 5, 7, 9]


class Scripted:
    """Proposes the plain greedy continuation (all accepted) while `right`, else tokens that are never the argmax;
    records the K the engine asks for."""

    def __init__(self, greedy: list[int], vocab: int) -> None:
        self.greedy, self.vocab, self.right, self.asked = greedy, vocab, False, []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = []
        for s, k in zip(seqs, ks):
            self.asked.append(k)
            done = s.num_output_tokens
            truth = self.greedy[done:done + k]
            out.append(Proposal(truth if self.right else [(t + 1) % self.vocab for t in truth]))
        return out

    def release(self, seq_id: int) -> None:
        pass
