"""A tiny random Llama saved as a Hugging Face folder: our loader, RoPE variants and engine against transformers.

Also shows that chunked prefill and preemption never change greedy outputs.
"""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams
from shared.testing.tiny_llama import save_tiny

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", list(ROPE))
def test_logits_and_greedy_match(tmp_path, kind):
    ref = save_tiny(tmp_path, ROPE[kind], tie=kind != "linear")
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16))
    ids = torch.randint(1, 90, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    got = eng.score(ids)
    assert (got - expect).abs().max().item() < 1e-4
    prompt = ids[:20]
    with torch.inference_mode():
        g = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                         temperature=None, top_p=None, top_k=None)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0][0]
    assert out == g[0, 20:].tolist()


def test_chunked_prefill_and_preemption_do_not_change_outputs(tmp_path):
    save_tiny(tmp_path, None)
    prompts = [torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 37, 70, 12, 50, 3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=256, block_size=16))
    alone = [roomy.generate([p], params)[0][0] for p in prompts]
    # 10 blocks of 16 tokens cannot hold all six sequences; 8-token steps force chunked prefill.
    tight = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=10, block_size=16,
                                   max_num_batched_tokens=8))
    together = [o[0] for o in tight.generate(prompts, params)]
    assert together == alone
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_used_blocks == 0


def test_request_that_can_never_fit_is_rejected_with_numbers(tmp_path):
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=2, block_size=16))
    with pytest.raises(InvalidRequest, match="needs 3 KV blocks but the cache has only 2"):
        eng.add_request("x", list(range(1, 41)), SamplingParams(temperature=0))
