"""The rejection sampler's cases, one by one, with exact expectations."""
from __future__ import annotations

import torch

from shared.engine.rejection import verify_greedy, verify_sampled


def onehot(i: int, v: int = 4) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), v).double()


def test_greedy_accepts_while_argmax_matches():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [5.0, 0, 0, 0]])
    assert verify_greedy(logits, [1, 2]) == (2, 0)           # all accepted, bonus = argmax of the last row
    assert verify_greedy(logits, [1, 3]) == (1, 2)           # first mismatch: the target's argmax instead
    assert verify_greedy(logits, [0, 2]) == (0, 1)


def test_all_accepted_then_bonus_from_p():
    p = torch.stack([onehot(1), onehot(2), onehot(3)])
    q = torch.stack([onehot(1), onehot(2)])
    assert verify_sampled(p, q, [1, 2], torch.Generator().manual_seed(0)) == (2, 3)


def test_p_zero_always_rejects_and_samples_the_residual():
    p = torch.stack([torch.tensor([0.0, 0.5, 0.5, 0.0]), onehot(0)])
    q = torch.stack([onehot(3)])                              # p(x=3) = 0
    for s in range(20):
        n, tok = verify_sampled(p, q, [3], torch.Generator().manual_seed(s))
        assert n == 0 and tok in (1, 2)


def test_q_zero_token_is_never_accepted():
    p = torch.stack([torch.tensor([0.25, 0.25, 0.25, 0.25]), onehot(0)])
    q = torch.stack([torch.tensor([0.0, 1.0, 0.0, 0.0])])     # the draft claims x=2 has probability 0
    n, tok = verify_sampled(p, q, [2], torch.Generator().manual_seed(1))
    assert n == 0 and tok in (0, 2, 3)                        # residual max(0, p - q) removes token 1


def test_first_rejection_residual_distribution():
    # p = [.5,.5,0,0], q = [1,0,0,0]: accept 0 w.p. .5; on rejection residual = [0, .5, 0, 0] -> always 1
    p = torch.stack([torch.tensor([0.5, 0.5, 0.0, 0.0]), onehot(3)])
    q = torch.stack([onehot(0)])
    out = [verify_sampled(p, q, [0], torch.Generator().manual_seed(s)) for s in range(4000)]
    accepted = sum(n for n, _ in out) / len(out)
    assert abs(accepted - 0.5) < 0.03
    assert {t for n, t in out if n == 0} == {1}
    assert {t for n, t in out if n == 1} == {3}


def test_point_mass_proposal_keeps_p():
    p = torch.stack([torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.25] * 4)])
    g = torch.Generator().manual_seed(7)
    first = torch.zeros(4)
    for _ in range(8000):
        n, tok = verify_sampled(p, None, [3], g)
        first[3 if n == 1 else tok] += 1
    assert torch.allclose(first / 8000, p[0].float(), atol=0.02)
