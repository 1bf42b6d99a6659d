"""Exact speculative verification: the emitted tokens follow the target distribution whatever the draft proposes.

For draft tokens x_1..x_K with draft probabilities q and target probabilities p (both shaped by the request's
temperature, top-p and top-k), one forward pass of the target gives p at all K + 1 positions. Then, in order:
  q(x) <= p(x): always accept x;
  q(x) >  p(x): accept with probability p(x) / q(x);
  at the first rejection emit a token drawn from norm(max(0, p - q)) and stop;
  all K accepted: emit a bonus token drawn from p at position K + 1.
A proposer without probabilities (n-gram lookup) proposes a point mass: q(x) = 1, so x is accepted with
probability p(x) and a rejection samples from p with x removed. Greedy requests accept while the draft token is the
target's argmax and emit the argmax where they stop, so greedy speculative output equals greedy output.
Shapes: K = draft tokens, V = vocab.
"""
from __future__ import annotations

import torch

from shared.engine.sampler import greedy_tokens


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """target_logits [K + 1, V] -> (accepted count n, the token emitted after them)."""
    best = greedy_tokens(target_logits).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sampled(p: torch.Tensor, q: torch.Tensor | None, draft: list[int],
                   generator: torch.Generator | None) -> tuple[int, int]:
    """p [K + 1, V] target probs, q [K, V] draft probs (None = point masses) -> (accepted n, emitted token)."""
    k = len(draft)
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist() if k else []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if qx > 0 and u[i] * qx < px:                 # u < p/q without dividing; q(x) = 0 cannot be proposed
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i]).clamp_min_(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]   # p == q exactly: nothing to correct, sample p
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))
