"""The router's choice between the draft service and plain decoding by load (Frontend.choose_draft)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.router.config import RouterConfig
from services.router.frontend import Frontend
from shared.sampling_params import SamplingParams


def frontend(limit: int) -> Frontend:
    drafts = [SimpleNamespace(up=True, in_flight=3, name="a"), SimpleNamespace(up=True, in_flight=1, name="b")]
    return Frontend(RouterConfig(speculative_max_requests=limit), None, [], None, drafts=drafts)


def test_speculates_up_to_the_limit_then_decodes_plainly():
    f = frontend(2)
    params = SamplingParams(temperature=0)
    for in_flight, chosen in [(1, "b"), (2, "b"), (3, None), (30, None)]:
        f.in_flight = in_flight                      # counts the request being routed
        d = f.choose_draft(params)
        assert (d.name if d else None) == chosen


def test_zero_means_always_and_an_explicit_k_still_speculates():
    assert frontend(0).choose_draft(SamplingParams()) is not None
    f = frontend(1)
    f.in_flight = 5
    assert f.choose_draft(SamplingParams()) is None
    assert f.choose_draft(SamplingParams(num_speculative_tokens=4)).name == "b"
    assert f.choose_draft(SamplingParams(num_speculative_tokens=0)) is None


def test_a_single_token_goes_straight_to_the_target():
    """max_tokens 1 (a prompt's first token, a classification, a time-to-first-token probe): the prefill makes the
    token, so there is nothing to draft, even for a request that sets K; the guard's schedule is not consumed."""
    f = frontend(1)
    f.in_flight = 1
    for k in (None, 4):
        assert f.choose_draft(SamplingParams(max_tokens=1, num_speculative_tokens=k)) is None
    assert f.guard.decisions == 0
    assert f.choose_draft(SamplingParams(max_tokens=2, num_speculative_tokens=4)).name == "b"
    assert f.choose_draft(SamplingParams(max_tokens=2)).name == "b"              # nothing measured: drafts


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="speculative_max_requests"):
        RouterConfig(speculative_max_requests=-1)


def test_guard_speculates_only_while_measured_faster_and_explores_both_sides():
    from services.router.spec_guard import RARE, SpeculationGuard
    g = SpeculationGuard(explore_every=4, alpha=1.0)
    assert g.use_drafts()                                   # nothing measured: the deployment's default
    g.record(True, 100, 2.0)                                # 50 tok/s with drafts
    g.record(False, 10, 0.01)                               # too short to count
    assert g.rate[False] is None
    picks = [g.use_drafts() for _ in range(8)]              # no plain rate yet: measured early, every other one
    assert picks == [False, True] * 4
    g.record(False, 100, 1.0)                               # 100 tok/s plain: speculation does not pay here
    picks = [g.use_drafts() for _ in range(8 * RARE)]       # twice as fast: drafts explored RARE times less often
    assert picks.count(False) == 8 * RARE - 2 and picks.count(True) == 2
    g.record(True, 100, 0.9)                                # 111 tok/s with drafts now: close, explored as often
    assert [g.use_drafts() for _ in range(8)].count(True) == 6


def test_a_side_that_clients_measure_themselves_is_not_explored():
    """Requests with their own K = 0 keep the plain rate current: the deployment's requests all keep drafting."""
    from services.router.spec_guard import SpeculationGuard
    g = SpeculationGuard(explore_every=4, alpha=1.0)
    g.record(True, 110, 1.0)                                # 110 tok/s with drafts
    picks = []
    for _ in range(16):
        g.record(False, 100, 1.0, own_choice=True)          # a client's own plain request: 100 tok/s
        picks.append(g.use_drafts())
    assert all(picks)
    g.record(False, 100, 1.0)                               # the guard's own choice: not a client's measurement
    assert [g.use_drafts() for _ in range(8)].count(False) == 2       # no plain requests now: explored again


def test_plain_requests_do_not_measure_a_side_that_drafts_by_lookup():
    """Where the targets draft by prompt lookup the requests sent without a draft service, a client's K = 0 request
    measures plain decoding, not that side: it is not recorded (and the side is explored as if unmeasured)."""
    from services.router.spec_guard import SpeculationGuard
    for lookup in (False, True):
        g = SpeculationGuard(explore_every=4, alpha=1.0, lookup_at_targets=lookup)
        g.record(True, 110, 1.0)
        g.record(False, 100, 1.0, own_choice=True, asked_plain=True)
        assert (g.rate[False] is None) == lookup
        g.record(False, 200, 1.0, own_choice=True)                  # a client's own K > 0 sent without drafts: kept
        assert g.rate[False] == 200


def test_with_lookup_at_the_targets_a_near_tie_goes_to_the_side_without_drafts():
    """That side gets lookup's speed-up too, without the draft service's relay and probes: drafts only while
    LOOKUP_TIE times faster; without lookup at the targets a tie still keeps drafting."""
    from services.router.spec_guard import LOOKUP_TIE, SpeculationGuard
    for lookup in (False, True):
        g = SpeculationGuard(explore_every=1000, alpha=1.0, lookup_at_targets=lookup)
        g.record(True, 102, 1.0)                                    # 2% faster with drafts
        g.record(False, 100, 1.0)
        assert g.use_drafts() == (not lookup)
        g.record(True, 100 * LOOKUP_TIE + 1, 1.0)                   # clearly faster: drafts either way
        assert g.use_drafts()


def test_router_follows_the_guard_for_a_request_alone_only():
    f = frontend(1)
    f.in_flight = 1
    f.guard.record(True, 100, 2.0)
    f.guard.record(False, 100, 1.0)
    f.guard.explore_every = 10 ** 9
    assert f.choose_draft(SamplingParams()) is None                          # plain is faster: no drafts
    assert f.choose_draft(SamplingParams(num_speculative_tokens=4)).name == "b"   # an explicit K is honoured
