"""What a target forward step costs by its rows, and draft-tree sizes that pay for their rows.

A verification step carries one row per draft node beside each sequence's root row. Where rows are nearly free
(bf16 on CPUs with native bf16 matmuls, a GPU) a tree of 8 or more nodes pays; where each row costs (fp32 on a
CPU without bf16: 9 rows cost about 2.4 times one row on the 2-core AVX2 EPYC this was measured on) the same tree
makes decoding slower than no speculation. So the target measures its step's wall time for a few row counts
(`measure`), and the drafts keep, among the tree nodes they ranked, the count that maximises expected tokens per
unit of step cost:

    n* = argmax_n (S + sum of the n best nodes' p) / cost(S + n)

over all greedy sequences of the step together (S = sequences, each giving one token per step whatever happens;
p = the head's probability of a node's whole path, which for a greedy target is the chance the node is accepted:
siblings are exclusive, so the expected accepted length of a tree is the sum of its nodes' p; the committed head
is calibrated, see README). Nodes are taken best first across sequences; a child never scores above its parent,
so every sequence's kept nodes contain their ancestors. n* = 0 drafts nothing this step (a plain decode). The
drafting already done is not counted: at selection it is spent either way.
"""
from __future__ import annotations

import time
from collections.abc import Callable

ROWS = (1, 2, 3, 5, 9, 17, 33, 65)      # row counts measured (interpolated linearly between them)


class StepCosts:
    """Relative wall time of a forward step by rows: costs[r - 1] for r rows, costs[0] = 1."""

    __slots__ = ("costs",)

    def __init__(self, costs: list[float]) -> None:
        if not costs or any(not c > 0 for c in costs):
            raise ValueError(f"step costs must be positive, one per row count from 1 on; got {costs[:8]}")
        self.costs = [c / costs[0] for c in costs]

    @classmethod
    def from_points(cls, points: dict[int, float]) -> "StepCosts":
        """Measured {rows: seconds} -> costs for every row count up to the largest, linear in between."""
        rows = sorted(points)
        if rows[0] != 1:
            raise ValueError("step costs need the one-row step")
        out = []
        for a, b in zip(rows, rows[1:]):
            out += [points[a] + (points[b] - points[a]) * (r - a) / (b - a) for r in range(a, b)]
        return cls(out + [points[rows[-1]]])

    def __call__(self, rows: int) -> float:
        """Relative cost of a step of `rows` rows (linear past the last measured count)."""
        c = self.costs
        if rows <= len(c):
            return c[max(rows, 1) - 1]
        slope = c[-1] - c[-2] if len(c) > 1 else 0.0
        return c[-1] + slope * (rows - len(c))


def tree_sizes(probs: list[list[float]], costs: StepCosts, base_rows: int) -> list[int]:
    """probs[i]: path probabilities of sequence i's ranked tree nodes (best first, ancestors before descendants);
    base_rows: rows of the step without drafts (>= the sequences here) -> how many of each sequence's nodes to
    verify (see the module docstring)."""
    ranked = sorted(((p, i) for i, ps in enumerate(probs) for p in ps), key=lambda x: -x[0])   # stable: keeps order
    tokens, best, best_val = float(base_rows), 0, base_rows / costs(base_rows)
    for n, (p, _) in enumerate(ranked, 1):
        tokens += p
        val = tokens / costs(base_rows + n)
        if val > best_val:
            best, best_val = n, val
    counts = [0] * len(probs)
    for _, i in ranked[:best]:
        counts[i] += 1
    return counts


def measure(forward: Callable[[int], None], max_rows: int, reps: int = 3) -> StepCosts:
    """forward(rows) runs one step of that many rows (synchronised); the best of `reps` timings after a warm-up,
    at the row counts of ROWS up to max_rows (at least 1 and 2). A shared machine's noise can make more rows look
    cheaper than fewer: the costs are made non-decreasing (a count costs at least any smaller one)."""
    points: dict[int, float] = {}
    for rows in [r for r in ROWS if r <= max(2, max_rows)]:
        forward(rows)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            forward(rows)
            best = min(best, time.perf_counter() - t)
        points[rows] = max([best] + list(points.values()))
    return StepCosts.from_points(points)
