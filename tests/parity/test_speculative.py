"""Speculative decoding keeps the target's outputs: greedy equality for every proposer and K, and the exact
sampling distribution (chi-square over 20,000 seeded runs) with a deliberately different draft."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine
from shared.testing.tiny_llama import PROMPTS

@pytest.fixture(scope="module")
def greedy_ref(tiny):
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4))
    return [o[0] for o in eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", ["ngram", "draft-model", "eagle", "eagle-tree", "eagle-tree-ngram",
                                      "eagle-lookup"])
def test_greedy_speculative_equals_greedy(tiny, tiny_eagle, greedy_ref, proposer, k):
    spec = {"ngram": "ngram", "draft-model": f"draft-model:{tiny}"}.get(proposer, f"eagle:{tiny_eagle}")
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4, speculative=spec,
                                 num_speculative_tokens=k, draft_confidence=0.0,
                                 draft_tree_ngram=4 if proposer == "eagle-tree-ngram" else 0,
                                 draft_tree_nodes=6 if proposer.startswith("eagle-tree") or proposer == "eagle-lookup"
                                 else 0))
    grafted = []
    if proposer == "eagle-tree-ngram":                       # count the trees that prompt lookup added nodes to
        graft = eng.proposer._graft

        def counting(seq, prop, *args):
            out = graft(seq, prop, *args)
            grafted.append(len(out.tokens) > len(prop.tokens))
            return out
        eng.proposer._graft = counting
    looked_up = []
    if proposer.startswith("eagle"):                         # count the sequences drafted by lookup alone
        lookup = eng.proposer.lookup
        lookup.n = 1 if proposer == "eagle-lookup" else 0
        chains = lookup.chains

        def counting_chains(seqs, ks):
            out = chains(seqs, ks)
            looked_up.append(len(out))
            return out
        lookup.chains = counting_chains
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == greedy_ref                 # batch 8
    assert eng.generate(PROMPTS[:1], params)[0][0] == greedy_ref[0]                    # batch 1
    if proposer == "eagle-tree-ngram":
        assert eng.proposer.tree_ngram == 4 and any(grafted)
    assert eng.block_manager.num_used_blocks == 0
    if proposer == "draft-model":
        assert eng.proposer.blocks.num_used_blocks == 0 and not eng.proposer.mirrors
    if proposer.startswith("eagle"):
        assert eng.stats_draft > 0 and not eng.proposer.states          # it drafted, and every state was freed
        assert bool(sum(looked_up)) == (proposer == "eagle-lookup") and not eng.proposer.lookup.tracks


def test_speculation_is_used_and_counted(tiny):
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4,
                                 speculative=f"draft-model:{tiny}", num_speculative_tokens=3))
    eng.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    last = None
    while eng.has_unfinished():
        for d in eng.step():
            last = d
    assert last.num_draft_tokens > 10
    assert last.num_accepted_tokens == last.num_draft_tokens    # the draft is the target itself: all accepted


def test_request_can_turn_speculation_off(tiny, greedy_ref):
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4, speculative="ngram"))
    eng.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                    num_speculative_tokens=0))
    out, last = [], None
    while eng.has_unfinished():
        for d in eng.step():
            out += d.token_ids
            last = d
    assert out == greedy_ref[0] and last.num_draft_tokens == 0


def test_lookup_for_requests_without_a_proposer_keeps_greedy_output(tiny, greedy_ref):
    """The target's lookup for requests that reach it without a draft service (ProposerMux lookup_unbound, the
    target's --lookup-speculation): greedy output unchanged, chains drafted and verified; none without the switch
    or for a request that turns speculation off."""
    from shared.spec.proposer_mux import ProposerMux
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for unbound in (True, False):
        eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4,
                                     num_speculative_tokens=5))
        eng.proposer = ProposerMux(eng.proposer, lookup_n=1, lookup_unbound=unbound)
        assert [o[0] for o in eng.generate(PROMPTS, params)] == greedy_ref                 # batch 8
        assert eng.generate(PROMPTS[:1], params)[0][0] == greedy_ref[0]                    # batch 1
        assert (eng.stats_draft > 0) == unbound and (eng.stats_accepted > 0) == unbound
        assert not eng.proposer.lookup.tracks and eng.block_manager.num_used_blocks == 0
    eng.proposer.lookup_unbound, drafted = True, eng.stats_draft
    off = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, num_speculative_tokens=0)
    assert [o[0] for o in eng.generate(PROMPTS, off)] == greedy_ref and eng.stats_draft == drafted


def test_lookup_chains_run_to_num_lookup_tokens_unless_the_request_sets_k(tiny):
    """Lookup chains of requests that leave K to the deployment go up to num_lookup_tokens (past K); a request that
    sets its own K gets chains of up to that K; greedy output unchanged either way. The tiny model repeats the
    prompt's last token, whose pair opens the prompt: its first decode step finds a long continuation."""
    from shared.spec.proposer_mux import ProposerMux
    prompt = [5, 5] + list(range(10, 80)) + [5]
    plain = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = plain.generate([prompt], params)[0][0]
    eng = build_engine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4,
                                    num_speculative_tokens=2, num_lookup_tokens=7))
    eng.proposer = ProposerMux(eng.proposer, lookup_n=1, lookup_unbound=True)
    lengths: list[int] = []
    chains = eng.proposer.lookup.chains

    def recorded(seqs, ks):
        out = chains(seqs, ks)
        lengths.extend(len(c) for c in out.values())
        return out
    eng.proposer.lookup.chains = recorded
    assert eng.generate([prompt], params)[0][0] == want
    assert max(lengths) == 7
    lengths.clear()
    own_k = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, num_speculative_tokens=2)
    assert eng.generate([prompt], own_k)[0][0] == want
    assert max(lengths) == 2


# ---------------------------------------------------------------- distribution exactness
V = 16


def save_small(path, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)                  # a peaked but not degenerate distribution
    model.save_pretrained(path)
    return model


def marginals(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Exact distribution of each of the first `steps` sampled tokens at temperature 1 (by enumeration)."""
    out, prefixes, weights = [], [prompt], torch.ones(1, dtype=torch.float64)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor(prefixes)).logits[:, -1].double()
            cond = logits.softmax(-1)                                         # [P, V]
            joint = weights[:, None] * cond                                   # [P, V]
            out.append(joint.sum(0))
            prefixes = [p + [t] for p in prefixes for t in range(V)]
            weights = joint.flatten()
    return out


def spec_accept_rate(eng: LLMEngine) -> float:
    return eng.stats_accepted / max(1, eng.stats_draft)


def empirical(eng: LLMEngine, prompt: list[int], runs: int, steps: int) -> torch.Tensor:
    counts = torch.zeros(steps, V, dtype=torch.float64)
    for start in range(0, runs, 2500):
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=steps + 1, ignore_eos=True)
                  for s in range(start, min(runs, start + 2500))]
        for (toks,) in eng.generate([prompt] * len(params), params):
            for i in range(steps):
                counts[i, toks[i]] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; p = Q(dof / 2, stat / 2) (regularised upper incomplete gamma)."""
    keep = probs > 1e-9
    if (counts[~keep] > 0).any():
        return 0.0                                    # a token the target can never produce was produced
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread avoids OpenMP hand-offs that dominate on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_distribution_matches_target_and_not_the_draft(tmp_path, one_thread):
    target = save_small(tmp_path / "target", 0)
    draft = save_small(tmp_path / "draft", 1)
    prompt = [3, 7, 1]
    exact = marginals(target, prompt, 3)
    big = dict(progress=False, num_kv_blocks=12000, block_size=4, max_num_seqs=2500, max_num_batched_tokens=16384)
    spec = build_engine(EngineConfig(model=str(tmp_path / "target"), speculative=f"draft-model:{tmp_path / 'draft'}",
                                  num_speculative_tokens=3, draft_kv_blocks=12000, **big))
    counts = empirical(spec, prompt, 20000, 3)
    pvals = [chi2_pvalue(counts[i], exact[i]) for i in range(3)]
    print("speculative p-values", pvals)
    assert all(p > 0.001 for p in pvals)
    assert 0 < spec_accept_rate(spec) < 1
    alone = build_engine(EngineConfig(model=str(tmp_path / "draft"), **big))
    draft_counts = empirical(alone, prompt, 20000, 3)
    draft_pvals = [chi2_pvalue(draft_counts[i], exact[i]) for i in range(3)]
    print("draft-alone p-values", draft_pvals)
    assert all(p < 0.001 for p in draft_pvals)
    assert spec.block_manager.num_used_blocks == 0 and spec.proposer.blocks.num_used_blocks == 0


@pytest.mark.slow
def test_distribution_with_an_eagle_head_matches_the_target(tmp_path, one_thread):
    """The same chi-square with the EAGLE proposer: a random head over the target's hidden states whose reduced
    vocab (12 of 16 tokens) gives q(x) = 0 to 4 tokens the target can still produce (through the residual)."""
    from shared.model.loader import load_config
    from shared.spec.eagle import EagleHead, head_config_for
    target = save_small(tmp_path / "target", 0)
    torch.manual_seed(2)
    head = EagleHead(head_config_for(load_config(str(tmp_path / "target")), 12))
    head.id_map = torch.randperm(V)[:12].sort().values
    head.save(str(tmp_path / "eagle"), torch.float32)
    prompt = [3, 7, 1]
    exact = marginals(target, prompt, 3)
    spec = build_engine(EngineConfig(model=str(tmp_path / "target"), speculative=f"eagle:{tmp_path / 'eagle'}",
                                  num_speculative_tokens=3, progress=False, num_kv_blocks=12000, block_size=4,
                                  max_num_seqs=2500, max_num_batched_tokens=16384, draft_confidence=0.0))
    counts = empirical(spec, prompt, 20000, 3)
    pvals = [chi2_pvalue(counts[i], exact[i]) for i in range(3)]
    print("eagle speculative p-values", pvals)
    assert all(p > 0.001 for p in pvals)
    assert 0 < spec_accept_rate(spec) < 1
    assert spec.block_manager.num_used_blocks == 0 and not spec.proposer.states
