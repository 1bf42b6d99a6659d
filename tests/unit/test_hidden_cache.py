"""The hidden cache: with an EAGLE head, the target keeps every cached position's hidden state beside its KV, so a
prefix-cache hit still gives the head the prompt's features (it drafts exactly as without the hit); blocks computed
before capture began are never handed out."""
from __future__ import annotations

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine
from shared.testing.tiny_llama import PROMPTS


def _run(eng: LLMEngine, prompt: list[int]):
    """(tokens, drafted, accepted) of one greedy request, and what the head was given: [(start, hidden)]."""
    given: list[tuple[int, torch.Tensor]] = []
    accept = eng.proposer.accept_hidden

    def recording(seq, start, hidden):
        given.append((start, hidden.clone()))
        return accept(seq, start, hidden)
    eng.proposer.accept_hidden = recording
    d0, a0 = eng.stats_draft, eng.stats_accepted
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0][0]
    eng.proposer.accept_hidden = accept
    return (out, eng.stats_draft - d0, eng.stats_accepted - a0), given


def test_a_prefix_cache_hit_gives_the_head_the_cached_features(tiny, tiny_eagle):
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4,
                                 speculative=f"eagle:{tiny_eagle}", num_speculative_tokens=3, draft_confidence=0.0,
                                 draft_tree_nodes=0, draft_tree_ngram=0))
    prompt = PROMPTS[5]                                               # 40 tokens: 10 full blocks
    cold, cold_given = _run(eng, prompt)
    warm, warm_given = _run(eng, prompt)
    assert eng.block_manager.num_used_blocks == 0
    assert cold_given[0][0] == 0 and len(cold_given[0][1]) == 40      # a cold prefill: every prompt row
    (s0, past), (s1, rows) = warm_given[:2]
    assert (s0, len(past), s1) == (0, 36, 36)                          # 36 cached rows, then the 4 computed
    ref = eng.hidden_states([prompt])[0]                               # [40, D], recomputed in one pass
    assert torch.allclose(past, ref[:36], atol=1e-4) and torch.allclose(rows, ref[36:], atol=1e-4)
    assert warm == cold and cold[1] > 0                                # same drafts, same acceptance, same output


def test_blocks_computed_before_capture_are_not_handed_out(tiny):
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=64, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.generate([PROMPTS[5]], params)                                  # its blocks cached, capture off
    assert eng.runner.hidden_cache is None
    eng.runner.capture_hidden()
    eng.add_request("hit", PROMPTS[5], params)
    eng.add_request("fresh", list(range(3, 30)), params)
    eng.step()                                                          # both prefills
    hit, fresh = eng.requests["hit"][0], eng.requests["fresh"][0]
    assert hit.num_cached_tokens == 36 and fresh.num_cached_tokens == 0
    assert eng.runner.cached_hidden(hit.block_table, 36) is None        # computed before capture began
    got = eng.runner.cached_hidden(fresh.block_table, 24)               # computed while capturing
    assert got is not None and torch.allclose(got, eng.hidden_states([list(range(3, 30))])[0][:24], atol=1e-4)


def test_capture_from_the_start_keeps_the_features_of_plainly_computed_prefixes(tiny):
    """`upesi target --capture-hidden` (what `upesi serve --draft eagle:...` asks for): capture begins with the
    engine, so a prefix a plain request computed before any EAGLE draft connected still has its features."""
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=64, block_size=4))
    eng.runner.capture_hidden()                                         # as services/target/main.py does
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.generate([PROMPTS[5]], params)                                  # plain: no proposer at all
    eng.add_request("hit", PROMPTS[5], params)
    eng.step()
    hit = eng.requests["hit"][0]
    assert hit.num_cached_tokens == 36
    got = eng.runner.cached_hidden(hit.block_table, 36)
    assert got is not None and torch.allclose(got, eng.hidden_states([PROMPTS[5]])[0][:36], atol=1e-4)
