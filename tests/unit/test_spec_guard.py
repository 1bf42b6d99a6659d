"""The speculation guard (shared/engine/spec_guard.py): its choice from measured costs per token, per batch size,
with a step of the other kind every PROBE_EVERY steps; and the engine following it: a plain step drafts nothing for
requests that left K to the deployment, requests with their own K are drafted for, only all-decode steps are
measured, and greedy output stays the plain greedy output."""
from __future__ import annotations

import pytest

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.spec_guard import BARE, LOOKUP, PROBE_EVERY, PROBE_STEPS, RARE, WEIGHT, SpecGuard
from shared.sampling_params import SamplingParams
from shared.testing.scripted_proposer import PROMPT, Scripted
from shared.testing.tiny_llama import save_tiny


def choices(guard: SpecGuard, seqs: int, n: int) -> list[bool]:
    return [guard.speculate(seqs) for _ in range(n)]


def test_speculation_is_the_default_until_measured():
    assert all(choices(SpecGuard(), 1, 3 * PROBE_EVERY))


def test_plain_steps_are_probed_once_speculation_is_measured():
    g = SpecGuard()
    g.observe(1, True, 0.03, 2)
    got = choices(g, 1, 2 * PROBE_EVERY)
    assert got.count(False) == 2 * PROBE_STEPS and not any(got[PROBE_EVERY - PROBE_STEPS:PROBE_EVERY])
    assert not any(got[2 * PROBE_EVERY - PROBE_STEPS:])


def test_the_cheaper_kind_per_token_wins_and_the_other_is_probed():
    g = SpecGuard()
    g.observe(1, True, 0.022, 1)             # 22 ms a token speculating
    g.observe(1, False, 0.020, 1)            # 20 ms plainly
    g.observe(4, True, 0.072, 8)             # 9 ms a token at 4 sequences
    g.observe(4, False, 0.040, 4)            # 10 ms
    one, four = choices(g, 1, PROBE_EVERY), choices(g, 4, PROBE_EVERY)
    assert one.count(True) == PROBE_STEPS and all(one[-PROBE_STEPS:])             # plain, but for the probe
    assert four.count(False) == PROBE_STEPS and not any(four[-PROBE_STEPS:])       # speculative, but for the probe
    assert all(choices(g, 2, 5))                            # another batch size: not measured yet


def test_a_clear_winner_is_probed_rarely():
    """Speculation at 6 ms a token against plain steps' 10 (more than CLEAR_MARGIN apart): plain steps only every
    RARE x PROBE_EVERY steps, so exploring the loser costs little."""
    g = SpecGuard()
    g.observe(1, True, 0.012, 2)
    g.observe(1, False, 0.010, 1)
    got = choices(g, 1, RARE * PROBE_EVERY)
    assert got.count(False) == PROBE_STEPS and not any(got[-PROBE_STEPS:])


def test_the_first_step_after_a_switch_is_not_measured():
    """A probe's first step still pays for the kind it left (a draft catching up): only its second counts."""
    g = SpecGuard()
    g.observe(1, True, 0.014, 2)
    g.observe(1, False, 0.008, 1)                            # 7 ms a token speculating, 8 plainly
    before = dict(g.averages)
    for _ in range(PROBE_EVERY - PROBE_STEPS):
        assert g.speculate(1)
        g.observe(1, True, 0.014, 2)
    assert not g.speculate(1)                                # the probe's first step: a switch
    g.observe(1, False, 0.100, 1)
    assert g.averages[(1, False)] == before[(1, False)]
    assert not g.speculate(1)                                # its second: measured
    g.observe(1, False, 0.020, 1)
    assert g.averages[(1, False)] != before[(1, False)] and g.cost[(1, False)] > 0.008
    assert g.speculate(1)                                    # back: a switch again, not measured
    g.observe(1, True, 0.100, 2)
    assert g.averages[(1, True)] == before[(1, True)]


def test_costs_are_exponential_averages_per_token():
    g = SpecGuard()
    g.observe(2, True, 0.04, 4)
    g.observe(2, True, 0.12, 4)
    g.observe(2, True, 0.5, 0)               # no token emitted: not counted
    assert abs(g.cost[(2, True)] - (0.01 + WEIGHT * (0.03 - 0.01))) < 1e-12


def test_a_token_costs_the_ratio_of_average_seconds_to_average_tokens():
    """Speculative steps alternate between a rejected draft (one token, 15 ms) and an accepted one (six tokens,
    20 ms): 35 ms for 7 tokens, 5 ms a token, cheaper than plain steps' 9; the mean of each step's ms per token
    (9.2) would call it dearer."""
    g = SpecGuard()
    for _ in range(40):
        g.observe(1, True, 0.015, 1)
        g.observe(1, True, 0.020, 6)
        g.observe(1, False, 0.009, 1)
    assert 0.0045 < g.cost[(1, True)] < 0.0065 and abs(g.cost[(1, False)] - 0.009) < 1e-9
    assert choices(g, 1, PROBE_EVERY - 1) == [True] * (PROBE_EVERY - 1)      # speculative until the probe


def test_lookup_is_weighed_among_the_steps_kept_from_the_proposer():
    """Steps without the proposer that verified lookup chains (12 ms for 2 tokens) against those that drafted
    nothing (4 ms for 1): lookup's chains are dropped but for a probe; the proposer's own choice still sees every
    step without it."""
    assert all(SpecGuard().lookup(1) for _ in range(3))     # lookup's chains are taken until measured
    g = SpecGuard()
    g.observe(1, False, 0.012, 2, looked=True)
    g.observe(1, False, 0.004, 1, looked=False)
    g.observe(1, True, 0.010, 2)
    assert g.cost[(1, LOOKUP)] == 0.006 and g.cost[(1, BARE)] == 0.004
    assert abs(g.cost[(1, False)] - (0.012 + WEIGHT * (0.004 - 0.012)) / (2 + WEIGHT * (1 - 2))) < 1e-12
    got = [g.lookup(1) for _ in range(RARE * PROBE_EVERY)]
    assert got.count(True) == 1 and got[-1]                 # 1.5x dearer: probed every RARE x PROBE_EVERY
    g.observe(1, False, 0.010, 5, looked=True)              # a copying stretch: 2 ms a token with chains
    for _ in range(10):
        g.observe(1, False, 0.010, 5, looked=True)
    assert all(g.lookup(1) for _ in range(PROBE_EVERY - 1))


class Fixed:
    """A guard that always answers `speculate` (and `lookup`) and records what the engine tells it."""

    def __init__(self, speculate: bool, lookup: bool = True) -> None:
        self.answer, self.looks, self.seen = speculate, lookup, []

    def speculate(self, seqs: int) -> bool:
        return self.answer

    def lookup(self, seqs: int) -> bool:
        return self.looks

    def observe(self, seqs: int, speculated: bool, seconds: float, tokens: int, looked: bool | None = None) -> None:
        self.seen.append((seqs, speculated, tokens) if looked is None else (seqs, speculated, tokens, looked))


def test_the_engine_follows_the_guard(tmp_path):
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                 num_speculative_tokens=3, speculation_guard=True))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy = eng.generate([PROMPT], params)[0][0]
    eng.proposer = prop = Scripted(greedy, eng.model_cfg.vocab_size)
    prop.right = True
    eng.spec_guard = plain = Fixed(False)
    assert eng.generate([PROMPT], params)[0][0] == greedy
    assert prop.asked == []                                  # plain steps only
    assert plain.seen and all(s[:3] == (1, False, 1) for s in plain.seen)   # each decode step: one sequence, a token
    assert len(plain.seen) == 12 - 2        # not the prefill, nor the first decode (it reads the prompt into a draft)
    own = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, num_speculative_tokens=2)
    assert eng.generate([PROMPT], own)[0][0] == greedy
    assert prop.asked and set(prop.asked) <= {1, 2}          # its own K: drafted for anyway
    zero = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, num_speculative_tokens=0)
    assert eng.generate([PROMPT], zero)[0][0] == greedy
    # steps of requests that set their own K say nothing of the guard's choice: not measured (K = 0 requests'
    # steps counted as drafting steps made drafting look as cheap as plain decoding)
    assert len(plain.seen) == 12 - 2
    eng.spec_guard = spec = Fixed(True)
    prop.asked = []
    assert eng.generate([PROMPT], params)[0][0] == greedy
    assert prop.asked and any(s[1] and s[2] > 1 for s in spec.seen)   # verified drafts: several tokens a step
    assert eng.block_manager.num_used_blocks == 0


def test_without_the_guard_nothing_is_measured(tmp_path):
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                 num_speculative_tokens=3))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    greedy = eng.generate([PROMPT], params)[0][0]
    eng.proposer = prop = Scripted(greedy, eng.model_cfg.vocab_size)
    eng.spec_guard = seen = Fixed(False)
    assert eng.generate([PROMPT], params)[0][0] == greedy
    assert prop.asked and seen.seen == []


@pytest.mark.parametrize("pays", [True, False])
def test_a_step_kept_from_the_proposer_drafts_by_lookup_where_it_pays(tmp_path, pays):
    """The guard decides about the proposer (a draft service, a head) and, apart, about prompt lookup: where the
    proposer drafts by lookup alone too (a target's mux), a step the guard keeps from it still gets lookup's chains
    for the text that repeats while lookup pays (`pays`), and is measured as a step without the proposer that
    verified chains; where they do not, none is verified and every step emits one token. Greedy output unchanged."""
    from shared.spec.proposer_mux import ProposerMux
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                 num_speculative_tokens=4, speculation_guard=True))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    greedy = eng.generate([PROMPT], params)[0][0]
    eng.proposer = ProposerMux(None, lookup_n=1, lookup_unbound=True)
    eng.spec_guard = plain = Fixed(False, lookup=pays)
    assert eng.generate([PROMPT], params)[0][0] == greedy
    assert plain.seen and all(not s[1] for s in plain.seen)                # each a step without the proposer
    if pays:
        assert eng.stats_draft > 0 and eng.stats_accepted > 0              # lookup drafted and was verified
        assert any(s[2] > 1 and s[3] for s in plain.seen)                  # ... some steps lookup's, several tokens
    else:
        assert eng.stats_draft == 0
        assert all(s == (1, False, 1, False) for s in plain.seen)
    assert eng.block_manager.num_used_blocks == 0
