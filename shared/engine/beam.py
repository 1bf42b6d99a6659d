"""Beam search over forked sequences, the same algorithm as transformers' `generate(num_beams=W)`.

Per step, with W live beams (1 before the first step) and g tokens generated so far:
  candidates = top 2W of (beam score + log p(token | beam)) over every beam and token
  a candidate "hits" when its token is EOS or when g + 1 reaches max_tokens;
  the next W beams are the best candidates that do not hit; hitting candidates among the top W are offered to the
  finished list with score / (g + 1) ** length_penalty, which keeps the best W;
  search stops when no candidate can continue, or when W beams have finished and the best live beam (normalised
  by its current length) cannot beat the worst finished one.
Beams are Sequences: a beam chosen k times is kept once and forked k - 1 times (blocks shared, copy-on-write);
a beam chosen 0 times is finished, which frees its blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.engine.sequence import Sequence

NEG = -1.0e9


@dataclass(slots=True)
class Choice:
    parent: Sequence
    token: int
    score: float


@dataclass
class BeamGroup:
    width: int
    max_tokens: int
    eos_token_ids: set[int]
    length_penalty: float = 1.0
    beams: list[Sequence] = field(default_factory=list)
    scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[tuple[float, list[int]]] = field(default_factory=list)   # (normalised score, output ids)
    improvable: bool = True
    done: bool = False
    pending: dict[int, torch.Tensor] = field(default_factory=dict)    # seq_id -> log-probs [V] of this step

    def advance(self, logprobs: torch.Tensor) -> list[Choice]:
        """logprobs [B, V] for self.beams (in order) -> the next beams. Sets `done` when the search is over."""
        w, vocab = self.width, logprobs.shape[-1]
        g = self.beams[0].num_output_tokens
        acc = (logprobs.float() + torch.tensor(self.scores)[:, None]).flatten()         # [B * V]
        top_scores, top_idx = acc.topk(min(2 * w, acc.numel()))
        cands = [(float(s), int(i) // vocab, int(i) % vocab) for s, i in zip(top_scores, top_idx)]
        hits = [tok in self.eos_token_ids or g + 1 >= self.max_tokens for _, _, tok in cands]
        # finished hypotheses: hitting candidates among the top W
        if self.improvable:
            for rank, ((score, b, tok), hit) in enumerate(zip(cands, hits)):
                if hit and rank < w:
                    self.finished.append((score / (g + 1) ** self.length_penalty,
                                          self.beams[b].output_ids + [tok]))
            self.finished.sort(key=lambda x: -x[0])
            del self.finished[w:]
        live = sorted(((s + (NEG if hit else 0.0), b, tok) for (s, b, tok), hit in zip(cands, hits)),
                      key=lambda x: -x[0])[:w]
        nxt = [Choice(self.beams[b], tok, s) for s, b, tok in live]
        best_live = nxt[0].score / (g + 1) ** self.length_penalty
        if len(self.finished) == w:
            self.improvable = self.improvable and best_live > self.finished[-1][0]
        self.done = all(hits) or not self.improvable
        return nxt

    def best(self) -> list[int]:
        return self.finished[0][1]
