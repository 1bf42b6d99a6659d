"""A frozen draft, seen from both sides. The router's stall watch over a draft's stream
(services.router.draft_client._unstalled): a silent stream whose draft does not answer its health check is given up
on after one probe; a silent stream whose draft answers is waited for up to its limit; output that flows is passed
through untouched. The target's wait for proposals (services.target.verify.StreamProposer.wait_s): the whole
timeout until answers are measured, then 10x their usual time, at least 0.2 s."""
from __future__ import annotations

import asyncio

import pytest

from services.router import draft_client
from services.router.draft_client import Stalled, _unstalled


async def _stream(gaps: list[float]):
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        yield i


def _collect(gaps, first_s, next_s, answers: bool) -> tuple[list[int], int]:
    probes = []

    async def alive() -> bool:
        probes.append(1)
        return answers

    async def main():
        return [x async for x in _unstalled(_stream(gaps), first_s, next_s, alive)]
    return asyncio.run(main()), len(probes)


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(draft_client, "PROBE_AFTER_S", 0.05)


def test_flowing_output_passes_without_a_probe():
    assert _collect([0.0, 0.01, 0.01], 10, 10, answers=False) == ([0, 1, 2], 0)


def test_a_silent_draft_that_does_not_answer_is_given_up_after_one_probe():
    with pytest.raises(Stalled):
        _collect([0.0, 5.0], 10, 10, answers=False)


def test_a_silent_draft_that_answers_is_waited_for_up_to_the_limit():
    out, probes = _collect([0.0, 0.3], 10, 10, answers=True)
    assert out == [0, 1] and probes >= 3                        # probed every 0.05 s, kept waiting
    with pytest.raises(Stalled):
        _collect([0.0, 5.0], 10, 0.2, answers=True)            # ... but not past its limit


def test_the_targets_wait_follows_the_drafts_measured_answers():
    from services.target.verify import StreamProposer
    p = StreamProposer(None, None, timeout_s=5.0)
    assert p.wait_s() == 5.0                                    # nothing measured: a first proposal may be slow
    p.answers, p.answer_s = 3, 0.004
    assert p.wait_s() == pytest.approx(0.2)                     # 10 x 4 ms is under the floor
    p.answer_s = 0.05
    assert p.wait_s() == pytest.approx(0.5)
    p.answer_s = 1.0
    assert p.wait_s() == 5.0                                    # never past the timeout
