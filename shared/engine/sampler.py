"""Turning logits into tokens: greedy, temperature, top-k, top-p, with a per-sequence seeded generator.

Shapes: N = rows to sample, V = vocab.
`probs_from_logits` is the single definition of "the distribution a request samples from"; speculative
verification uses it for the target p and the draft q alike.
"""
from __future__ import annotations

import torch

from shared.engine.sequence import Sequence


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32, temperature/top_p [N] float, top_k [N] int (0 = off) -> probs [N, V]."""
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)                 # [N, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = rank >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # top-p: keep the smallest head of the sorted distribution whose mass reaches top_p.
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(dim=-1))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [N, V] (row i belongs to seqs[i]) -> one token per row."""
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        ps = [seqs[i].params for i in rows]
        probs = probs_from_logits(
            logits[rows],
            torch.tensor([p.temperature for p in ps], device=logits.device),
            torch.tensor([p.top_k for p in ps], device=logits.device),
            torch.tensor([p.top_p for p in ps], device=logits.device),
        )
        for j, i in enumerate(rows):
            out[i] = int(torch.multinomial(probs[j], 1, generator=seqs[i].generator))
    return out
