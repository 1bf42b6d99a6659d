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


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="speculative_max_requests"):
        RouterConfig(speculative_max_requests=-1)
