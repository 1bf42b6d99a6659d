"""Whether speculating pays, measured as the engine runs (EngineConfig.speculation_guard).

A verification step carries a sequence's drafts as extra rows. Where the target's matmuls are bound by memory at
one row, those rows come nearly free and speculation pays; where they are bound by arithmetic (small CPUs, packed
4-bit layers on AVX2) a step of six rows can cost close to six plain steps, and speculation loses. Which case holds
depends on the machine, the weights and the load, so the engine measures it: for each number of decoding sequences,
the seconds per emitted token of steps that ask the proposer for drafts and of steps that do not (the ratio of
exponential averages of a step's seconds and of its tokens), and it asks while that is the cheaper. Every
PROBE_EVERY steps it takes the other kind for PROBE_STEPS steps, so both figures stay current (every RARE x
PROBE_EVERY while one kind is CLEAR_MARGIN times cheaper); the first step after a switch is not measured, as it
still pays for the kind it left (measured, it made each kind look dearer when probed than when chosen, and the
guard kept whichever it began with). Where the proposer drafts by prompt lookup alone too (a target's mux), steps
of both kinds get lookup's chains for the text that repeats: the guard weighs the draft service against lookup
alone.

Lookup is weighed the same way among the steps kept from the proposer: where it found chains, the cost of a token
of steps that verified them against that of steps that drafted nothing. Where the matches are spurious (chat) and a
step's extra rows are dear (a CPU whose plain step is a few ms), its chains cost more than they bring and the step
decodes plainly; where the answer copies the prompt they pay many times over.

Only steps whose sequences all decode and leave K to the deployment count (a prefill's rows would swamp them; a
request that set its own K drafts, or not, whatever the guard chose). Greedy output is the same either way
and sampled output keeps its distribution, so the choice changes speed only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16       # steps between probes of the kind not chosen
PROBE_STEPS = 2        # steps a probe lasts: the first step after a switch of kind is not measured (it still pays
                       # for the kind it left: a draft catching up on the steps it missed, a draft service busy
                       # with the last verdicts), so a lone probe would never measure its kind as it runs
CLEAR_MARGIN = 1.25    # where one kind costs this many times less a token than the other,
RARE = 4               # the other is probed RARE times less often: a clear choice costs little exploring
WEIGHT = 0.1           # weight of a new step in the averages: about the last 10 steps of each kind
LOOKUP, BARE = "lookup", "bare"   # steps kept from the proposer: with prompt lookup's chains, with no drafts


@dataclass(slots=True)
class SpecGuard:
    # (decoding seqs, drafted) -> (seconds a step, tokens a step), exponential averages. Their ratio is the cost
    # of a token: an average of each step's seconds / tokens would count a step that emitted one token as heavily
    # as one that emitted six, and so overstate speculation's cost (the mean of 1 / t exceeds 1 / the mean of t).
    # Keys (seqs, True / False) for the proposer's choice, (seqs, LOOKUP / BARE) for lookup's.
    averages: dict[tuple[int, bool | str], tuple[float, float]] = field(default_factory=dict)
    steps: int = 0
    lookup_steps: int = 0
    last: bool | None = None         # whether the latest step asked the proposer
    switched: bool = False           # ... and the step before did not, or the other way round: not measured

    @property
    def cost(self) -> dict[tuple[int, bool | str], float]:
        """(decoding seqs, kind) -> seconds a token."""
        return {key: self._cost(key) for key in self.averages}

    def _cost(self, key: tuple[int, bool | str]) -> float | None:
        found = self.averages.get(key)
        return None if found is None else found[0] / found[1]

    def speculate(self, seqs: int) -> bool:
        """Whether the coming step, with `seqs` sequences decoding, should ask the proposer for drafts."""
        self.steps += 1
        choice = self._prefer((seqs, True), (seqs, False), self.steps, PROBE_STEPS)
        self.switched, self.last = self.last is not None and choice != self.last, choice
        return choice

    def lookup(self, seqs: int) -> bool:
        """Whether a step kept from the proposer, with `seqs` sequences decoding, should verify the chains prompt
        lookup found for it (asked only where it found some)."""
        self.lookup_steps += 1
        return self._prefer((seqs, LOOKUP), (seqs, BARE), self.lookup_steps, 1)   # switching costs nothing

    def _prefer(self, drafts: tuple[int, bool | str], none: tuple[int, bool | str], step: int, length: int) -> bool:
        """Whether the step `step` of a choice drafts: the kind cheaper a token, the other for `length` steps every
        PROBE_EVERY (RARE times less often where one is CLEAR_MARGIN cheaper); drafting until measured."""
        spec, plain = self._cost(drafts), self._cost(none)
        probe = _probing(step, PROBE_EVERY, length)
        if spec is None:
            return True                          # speculation is the default until measured
        if plain is None:
            return not probe
        if max(spec, plain) >= CLEAR_MARGIN * min(spec, plain):
            probe = _probing(step, RARE * PROBE_EVERY, length)
        return (spec <= plain) != probe

    def observe(self, seqs: int, drafted: bool, seconds: float, tokens: int, looked: bool | None = None) -> None:
        """A decode step of `seqs` sequences (that asked the proposer or not) took `seconds`, emitted `tokens`;
        `looked`, for a step that did not ask: whether it verified lookup chains."""
        if tokens <= 0 or self.switched:
            return
        self._add((seqs, drafted), seconds, tokens)
        if not drafted and looked is not None:
            self._add((seqs, LOOKUP if looked else BARE), seconds, tokens)

    def _add(self, key: tuple[int, bool | str], seconds: float, tokens: int) -> None:
        old = self.averages.get(key)
        self.averages[key] = (seconds, float(tokens)) if old is None else (
            old[0] + WEIGHT * (seconds - old[0]), old[1] + WEIGHT * (tokens - old[1]))


def _probing(step: int, every: int, length: int) -> bool:
    """Whether step `step` (counted from 1) is one of the last `length` of each `every`."""
    return (step - 1) % every >= every - length
