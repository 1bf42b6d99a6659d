"""Whether speculating pays, measured as the engine runs (EngineConfig.speculation_guard).

A verification step carries a sequence's drafts as extra rows. Where the target's matmuls are bound by memory at
one row, those rows come nearly free and speculation pays; where they are bound by arithmetic (small CPUs, packed
4-bit layers on AVX2) a step of six rows can cost close to six plain steps, and speculation loses. Which case holds
depends on the machine, the weights and the load, so the engine measures it: for each number of decoding sequences,
the seconds per emitted token of speculative steps and of plain steps (exponential averages), and it speculates while
that is the cheaper. Every PROBE_EVERY steps it takes the other kind, so both figures stay current.

Only steps whose sequences all decode count (a prefill's rows would swamp them). Greedy output is the same either way
and sampled output keeps its distribution, so the choice changes speed only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16       # steps between steps of the kind not chosen
WEIGHT = 0.25          # weight of a new step in the averages


@dataclass(slots=True)
class SpecGuard:
    cost: dict[tuple[int, bool], float] = field(default_factory=dict)   # (decoding seqs, speculated) -> s / token
    steps: int = 0

    def speculate(self, seqs: int) -> bool:
        """Whether the coming step, with `seqs` sequences decoding, should speculate."""
        self.steps += 1
        spec, plain = self.cost.get((seqs, True)), self.cost.get((seqs, False))
        probe = self.steps % PROBE_EVERY == 0
        if spec is None:
            return True                          # speculation is the default until measured
        if plain is None:
            return not probe
        return (spec <= plain) != probe

    def observe(self, seqs: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode step of `seqs` sequences took `seconds` and emitted `tokens`."""
        if tokens <= 0:
            return
        key, per_token = (seqs, speculated), seconds / tokens
        old = self.cost.get(key)
        self.cost[key] = per_token if old is None else old + WEIGHT * (per_token - old)
