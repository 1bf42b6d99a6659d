"""Step costs by rows and the draft-tree sizes they give (shared.engine.step_costs): interpolation, the choice of
nodes that pay for their rows (worked by hand), and the measurement on a fake clock."""
from __future__ import annotations

import pytest

import shared.engine.step_costs as sc
from shared.engine.step_costs import StepCosts, measure, tree_sizes


def test_costs_are_relative_interpolated_and_extrapolated():
    c = StepCosts.from_points({1: 0.02, 3: 0.03, 5: 0.05})
    assert c.costs == pytest.approx([1.0, 1.25, 1.5, 2.0, 2.5])
    assert c(0) == c(1) == 1.0 and c(4) == pytest.approx(2.0)
    assert c(7) == pytest.approx(3.5)                                 # past the last: the last slope (0.5 a row)
    assert StepCosts([3.0])(10) == 1.0
    for bad in ([], [1.0, 0.0], [-1.0]):
        with pytest.raises(ValueError):
            StepCosts(bad)
    with pytest.raises(ValueError, match="one-row"):
        StepCosts.from_points({2: 1.0, 4: 2.0})


def test_tree_sizes_keep_the_nodes_that_pay_for_their_rows():
    costs = StepCosts([1.0, 1.2, 1.4, 2.0, 2.6])
    # one sequence: n = 0: 1 / 1; n = 1: 1.9 / 1.2 = 1.58; n = 2: 2.4 / 1.4 = 1.71 (best); n = 3: 2.5 / 2.0
    assert tree_sizes([[0.9, 0.5, 0.1]], costs, 1) == [2]
    assert tree_sizes([[0.9, 0.5, 0.1]], StepCosts([1.0] * 8), 1) == [3]          # free rows: every node
    assert tree_sizes([[0.9, 0.5, 0.1]], StepCosts([2.0 ** r for r in range(8)]), 1) == [0]   # none pays
    assert tree_sizes([[], []], costs, 2) == [0, 0]
    # two sequences, nodes taken best first across them: rows 2..6 cost 1, 1.1, 1.25, 1.5, 2 (relative to row 1)
    two = StepCosts([1.0, 1.0, 1.1, 1.25, 1.5, 2.0])
    # n = 0: 2 / 1; + 0.9: 2.9 / 1.1 = 2.64; + 0.6: 3.5 / 1.25 = 2.8 (best); + 0.5: 4.0 / 1.5; + 0.2: 4.2 / 2
    assert tree_sizes([[0.9, 0.2], [0.6, 0.5]], two, 2) == [1, 1]


def test_measure_takes_the_best_timing_and_never_lets_more_rows_cost_less(monkeypatch):
    clock = [0.0]
    seconds = {1: [1.0, 0.5, 0.6, 0.7], 2: [1.0, 0.9, 0.8, 0.9], 3: [1.0, 0.6, 0.6, 0.6], 5: [2.0, 1.5, 1.6, 1.5]}
    calls: dict[int, int] = {}

    def forward(rows: int) -> None:                                   # warm-up, then 3 timed runs per count
        i = calls[rows] = calls.get(rows, -1) + 1
        clock[0] += seconds[rows][i]
    monkeypatch.setattr(sc.time, "perf_counter", lambda: clock[0])
    costs = measure(forward, 5)
    assert set(calls) == {1, 2, 3, 5} and all(n == 3 for n in calls.values())     # counts of ROWS up to 5
    # best timings 0.5, 0.8, 0.6 -> 0.8 (noise made 3 rows look cheaper than 2), 1.5
    assert costs.costs == pytest.approx([1.0, 1.6, 1.6, 2.3, 3.0])
