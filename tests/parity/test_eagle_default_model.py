"""The committed EAGLE head on the default model: greedy speculative output equals greedy output (batch 1 and a
batch of 3), and the head is a trained one (a share of its drafts far above chance is accepted)."""
from __future__ import annotations

import torch

from shared.sampling_params import SamplingParams
from shared.spec.factory import make_proposer
from tests.conftest import ROOT

HEAD = ROOT / "models" / "eagle-smollm2-135m"
TOKENS = 32


def test_committed_head_keeps_greedy_output_and_is_accepted(engine, chat_prompt_ids):
    prompts = chat_prompt_ids[:3]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, num_speculative_tokens=4)
    plain = [o[0] for o in engine.generate(prompts, params)]
    engine.proposer = make_proposer(f"eagle:{HEAD}", 0, 16, torch.float32, torch.device("cpu"), 2048,
                                    target=engine.runner.model)
    try:
        draft0, acc0 = engine.stats_draft, engine.stats_accepted
        assert engine.generate(prompts[:1], params)[0][0] == plain[0]                      # batch 1
        assert [o[0] for o in engine.generate(prompts, params)] == plain                   # batch 3
        drafted, accepted = engine.stats_draft - draft0, engine.stats_accepted - acc0
        assert not engine.proposer.states
    finally:
        engine.proposer = None
    print(f"committed head: {accepted} of {drafted} drafts accepted")
    assert drafted > 0 and accepted / drafted > 0.1             # greedy, so deterministic
