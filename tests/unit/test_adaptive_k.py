"""Adaptive K: a request's K drops by one after a verification that accepted none of its drafts and grows by one
(up to the deployment's K) after one that accepted all; `adaptive_speculation=False` always asks for K. Greedy
output stays the plain greedy output either way."""
from __future__ import annotations

import pytest

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.testing.scripted_proposer import PROMPT, Scripted
from shared.testing.tiny_llama import save_tiny

TOKENS, K = 24, 4


@pytest.mark.parametrize("adaptive", [True, False])
def test_k_follows_acceptance_only_when_adaptive(tmp_path, adaptive):
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                 num_speculative_tokens=K, adaptive_speculation=adaptive))
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    greedy = eng.generate([PROMPT], params)[0][0]
    eng.proposer = prop = Scripted(greedy, eng.model_cfg.vocab_size)
    wrong = eng.generate([PROMPT], params)[0][0]
    asked_wrong, prop.asked = prop.asked, []
    prop.right = True
    right = eng.generate([PROMPT], params)[0][0]
    assert wrong == greedy and right == greedy
    if adaptive:
        assert asked_wrong[:5] == [4, 3, 2, 1, 1]              # down by one after each verification with none accepted
        assert min(asked_wrong) == 1
    else:
        # K every time, but never past max_tokens (one token a verification: the correction)
        assert asked_wrong == [min(K, TOKENS - n - 1) for n in range(1, TOKENS - 1)]
    assert prop.asked[0] == K and set(prop.asked[:-1]) == {K}  # all accepted: K stays at the deployment's K
    assert eng.block_manager.num_used_blocks == 0


def test_no_drafts_while_more_sequences_run_than_speculative_max_seqs(tmp_path):
    """speculative_max_seqs = 2: three running sequences decode plainly; once one has finished, the other two are
    drafted for again. Outputs stay the plain greedy ones."""
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                 num_speculative_tokens=K, speculative_max_seqs=2))
    prompts = [PROMPT, [4, 6, 8], [2, 9]]
    lens = [6, 20, 20]
    plain = [eng.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0][0]
             for p, n in zip(prompts, lens)]
    seen: list[int] = []

    class Counting(Scripted):
        def propose(self, seqs, ks):
            seen.append(len(eng.scheduler.running))
            return super().propose(seqs, ks)

    eng.proposer = Counting(plain[0], eng.model_cfg.vocab_size)
    for i, (p, n) in enumerate(zip(prompts, lens)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert [out[f"r{i}"] for i in range(3)] == plain
    assert seen and max(seen) <= 2                        # never asked with three running
    from services.launcher import ServeConfig
    from services.target.config import TargetConfig
    for cls in (EngineConfig, TargetConfig, ServeConfig):
        with pytest.raises(ValueError, match="speculative_max_seqs"):
            cls(speculative_max_seqs=-1)


def test_no_drafts_while_sequences_wait_to_join_a_batch_that_would_pass_the_limit(tmp_path):
    """speculative_max_seqs = 1: a sequence running alone is not drafted for while another waits to be admitted (the
    next step runs both, plainly); once it runs alone it is."""
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                 num_speculative_tokens=K, speculative_max_seqs=1))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = eng.generate([PROMPT], params)[0][0]
    asked: list[tuple[int, int]] = []

    class Counting(Scripted):
        def propose(self, seqs, ks):
            asked.append((len(eng.scheduler.running), len(eng.scheduler.waiting)))
            return super().propose(seqs, ks)

    eng.proposer = Counting(plain, eng.model_cfg.vocab_size)
    eng.add_request("first", PROMPT, params)
    eng.step()                                            # its prefill: running alone now
    eng.add_request("second", [4, 6, 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()                                            # "second" was waiting: no proposal
    assert asked == []
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert asked and all(r == 1 and w == 0 for r, w in asked)   # drafted for again once alone
    assert eng.block_manager.num_used_blocks == 0
