"""Routing variants and the expert seam against plain per-token loops."""
from __future__ import annotations

import math

import pytest
import torch

from shared.model.moe import ROUTING, LocalExperts, MoEBlock, RoutingConfig

T, E, D = 24, 8, 16


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed))


def _as_dicts(ids: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: list[dict[int, float]]) -> None:
    ids, weights = got
    assert ids.shape == weights.shape == (T, len(want[0]))
    for g, w in zip(_as_dicts(ids, weights), want):
        assert g.keys() == w.keys()
        assert all(math.isclose(g[e], w[e], rel_tol=1e-6) for e in w)


def _softmax_loop(logits: torch.Tensor, k: int, renormalize: bool) -> list[dict[int, float]]:
    out = []
    for row in logits.tolist():
        z = sum(math.exp(v) for v in row)
        probs = [math.exp(v) / z for v in row]
        chosen = sorted(range(E), key=lambda e: -probs[e])[:k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        out.append({e: probs[e] / total for e in chosen})
    return out


def _sigmoid_group_loop(logits: torch.Tensor, bias: list[float], k: int, groups: int, keep: int,
                        scale: float) -> list[dict[int, float]]:
    out, per = [], E // groups
    for row in logits.tolist():
        score = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + b for s, b in zip(score, bias)]
        group_score = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        eligible = [e for e in range(E) if e // per in kept]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:k]
        total = sum(score[e] for e in chosen)
        out.append({e: score[e] / total * scale for e in chosen})
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_loop(renormalize):
    logits = _logits()
    rc = RoutingConfig("softmax_topk", E, 2, renormalize=renormalize)
    _assert_same(ROUTING["softmax_topk"](logits, rc), _softmax_loop(logits, 2, renormalize))


@pytest.mark.parametrize("groups,keep", [(4, 2), (2, 1), (1, 1)])
def test_sigmoid_group_topk_matches_loop(groups, keep):
    logits = _logits(1)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(2)) * 0.3
    rc = RoutingConfig("sigmoid_group_topk", E, 3, n_group=groups, topk_group=keep, scaling_factor=2.5)
    got = ROUTING["sigmoid_group_topk"](logits, rc, bias)
    _assert_same(got, _sigmoid_group_loop(logits, bias.tolist(), 3, groups, keep, 2.5))
    if groups > 1:                     # every token's experts lie in its kept groups only
        assert all(len({e // (E // groups) for e in row}) <= keep for row in got[0].tolist())


def test_correction_bias_chooses_but_does_not_weigh():
    logits = torch.zeros(T, E)
    bias = torch.zeros(E)
    bias[5] = bias[6] = 1.0
    rc = RoutingConfig("sigmoid_group_topk", E, 2, renormalize=False)
    ids, weights = ROUTING["sigmoid_group_topk"](logits, rc, bias)
    assert sorted(ids[0].tolist()) == [5, 6]
    assert torch.allclose(weights, torch.full((T, 2), 0.5))          # sigmoid(0), bias left out


def test_bad_routing_config_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        RoutingConfig("nope", E, 2)
    with pytest.raises(ValueError, match="groups"):
        RoutingConfig("sigmoid_group_topk", E, 2, n_group=3)


def _experts(layer: int = 3) -> LocalExperts:
    torch.manual_seed(0)
    experts = LocalExperts(layer, E, D, 12)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return experts


def test_local_experts_match_loop_and_run_only_hit_experts():
    experts = _experts()
    x = torch.randn(T, D)
    ids = torch.randint(0, E - 2, (T, 2))                 # experts E-2 and E-1 are never hit
    ids[:, 1] = (ids[:, 0] + 1) % (E - 2)                 # two distinct experts per token
    w = torch.rand(T, 2)
    want = torch.stack([sum(w[t, j] * experts[int(ids[t, j])](x[t]) for j in range(2)) for t in range(T)])
    calls = [0] * E
    for e, m in enumerate(experts):
        m.register_forward_hook(lambda *_, e=e: calls.__setitem__(e, calls[e] + 1))
    got = experts.moe(3, x, ids, w)
    assert torch.allclose(got, want, atol=1e-5)
    hit = set(ids.flatten().tolist())
    assert calls == [int(e in hit) for e in range(E)]     # each hit expert once, on all its tokens; the rest never
    with pytest.raises(ValueError, match="layer 3"):
        experts.moe(4, x, ids, w)


class _Recorder:
    """A stand-in remote backend: records what it is sent, answers zeros."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def moe(self, layer, hidden, topk_ids, topk_weights):
        self.calls.append((layer, hidden, topk_ids, topk_weights))
        return torch.zeros_like(hidden)


def test_moe_block_sends_every_routed_slot_through_the_backend():
    rc = RoutingConfig("softmax_topk", E, 2)
    block = MoEBlock(5, D, 12, rc, shared_inter=10, shared_gate=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert block.backend is block.experts and "backend" not in dict(block.named_modules())
    x = torch.randn(T, D)
    full = block(x)
    block.backend = _Recorder()
    shared_only = block(x)
    (layer, hidden, ids, weights), = block.backend.calls
    assert layer == 5 and hidden is x and ids.shape == weights.shape == (T, 2)
    shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    assert torch.allclose(shared_only, shared)
    assert torch.allclose(full, block.experts.moe(5, x, ids, weights) + shared, atol=1e-6)
