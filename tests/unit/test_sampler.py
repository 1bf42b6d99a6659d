"""Sampling filters against a plain, loop-based reference; seeds reproduce."""
from __future__ import annotations

import math

import pytest
import torch

from shared.engine.sampler import greedy_tokens, probs_from_logits, sample
from shared.engine.sequence import Sequence
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Textbook definition: temperature, keep the k most likely, then the smallest head with mass >= top_p."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k > 0 else order
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    total = sum(w.values())
    head, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        head.append(i)
        mass += w[i] / total
    total = sum(w[i] for i in head)
    return [w[i] / total if i in head else 0.0 for i in range(len(z))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8),
                                                       (0.5, 5, 0.6), (2.0, 1, 1.0), (1.0, 0, 1e-6)])
def test_probs_match_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g) * 3
    got = probs_from_logits(logits, torch.full((3,), temperature), torch.full((3,), top_k), torch.full((3,), top_p))
    for row in range(3):
        ref = reference_probs(logits[row].tolist(), temperature, top_k, top_p)
        assert torch.allclose(got[row], torch.tensor(ref), atol=1e-6)


def seqs(params: SamplingParams, n: int) -> list[Sequence]:
    return [Sequence("r", i, [1, 2], params) for i in range(n)]


def test_greedy_is_argmax_and_seeded_sampling_reproduces():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert sample(logits, seqs(SamplingParams(temperature=0), 4)) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=7)
    assert sample(logits, seqs(p, 4)) == sample(logits, seqs(p, 4))
    # choice i uses seed + i: choice 1 with seed 7 is choice 0 with seed 8
    eight = SamplingParams(temperature=1.0, seed=8)
    assert sample(logits[1:2], [Sequence("x", 1, [1], p)]) == sample(logits[1:2], [Sequence("y", 0, [1], eight)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_take_the_first_maximum_of_each_row(dtype):
    """Rows of few distinct values (ties everywhere) and one row of NaN-free random logits at a real vocab size:
    each row's token is the first index holding its maximum, as a plain loop finds it."""
    g = torch.Generator().manual_seed(2)
    ties = torch.randint(0, 4, (33, 257), generator=g).to(dtype)
    wide = torch.randn(5, 49152, generator=g).to(dtype)
    for logits in (ties, wide):
        want = [row.index(max(row)) for row in logits.float().tolist()]
        assert greedy_tokens(logits).tolist() == want


def test_sampling_frequencies_follow_probs():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    s = Sequence("r", 0, [1], SamplingParams(temperature=1.0, seed=3))
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, [s])[0]] += 1
    assert torch.allclose(counts / 4000, logits.softmax(-1)[0], atol=0.03)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.01), dict(top_k=-2),
                                dict(max_tokens=0), dict(n=0), dict(temperature=float("nan"))])
def test_invalid_params(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw)


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    for t in (1e-40, 1e-300, 1e-6):
        assert sample(logits, seqs(SamplingParams(temperature=t, seed=1), 2)) == logits.argmax(-1).tolist()


def test_candidate_pass_equals_full_sort_on_every_kind_of_row():
    """Filtered rows are first ranked over the CANDIDATES most likely tokens; rows that pass cannot decide (top-k
    above CANDIDATES, or a top-p head longer than CANDIDATES) sort the whole vocab. Either way the result is the
    full-sort definition, also when both kinds share a batch."""
    from shared.engine.sampler import CANDIDATES, _sorted_filtered_probs
    g = torch.Generator().manual_seed(5)
    v = 4096
    peaked = torch.randn(v, generator=g) * 6          # top-p heads of a few tokens
    flat = torch.randn(v, generator=g) * 0.1          # a top-p head of thousands of tokens
    logits = torch.stack([peaked, flat, peaked, flat, peaked, flat])
    top_k = torch.tensor([0, 0, 100, 3 * CANDIDATES, 3 * CANDIDATES, 7])
    top_p = torch.tensor([0.9, 0.9, 0.95, 1.0, 0.999, 0.5])
    temperature = torch.tensor([0.8, 1.0, 1.0, 1.0, 1.3, 1.0])
    got = probs_from_logits(logits, temperature, top_k, top_p)
    want = _sorted_filtered_probs(logits / temperature[:, None], top_k, top_p)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    kept = (got > 0).sum(-1).tolist()
    assert kept[1] > CANDIDATES and kept[3] == 3 * CANDIDATES and kept[2] <= 100 and kept[5] <= 7, kept
    for row in (0, 5):                                # and the textbook definition
        ref = reference_probs(logits[row].tolist(), float(temperature[row]), int(top_k[row]), float(top_p[row]))
        torch.testing.assert_close(got[row], torch.tensor(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("v", [49152, 1000, 7])
def test_two_level_inverse_transform_equals_one_cumsum(v):
    """The block-then-token inverse transform picks the token a single float64 cumsum over the vocab picks (the
    first whose cumulative mass exceeds u * total), never one of probability 0, for any vocab size."""
    from shared.engine.sampler import inverse_transform
    g = torch.Generator().manual_seed(v)
    probs = (torch.randn(64, v, generator=g) * 3).softmax(-1)
    keep = (torch.rand(32, v, generator=g) < 0.02) | (torch.arange(v) == torch.arange(32)[:, None] % v)
    probs[:32] *= keep                                                  # mostly zeros: top-k / top-p shaped rows
    probs[0] = 0
    probs[0, v - 1] = 1.0                                               # all the mass on the last token
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[1] = 0.0
    u[2] = 1 - 2 ** -52
    got = inverse_transform(probs, u, block=256 if v > 256 else 4)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(v - 1)
    assert (probs[torch.arange(64), got] > 0).all()
    assert (got == want).float().mean() > 0.98, (got != want).nonzero()   # only float32 block-sum rounding differs
    assert got[0] == v - 1
