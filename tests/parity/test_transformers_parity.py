"""Our Llama implementation and engine against transformers on the same checkpoint (fp32)."""
from __future__ import annotations

from pathlib import Path

import torch

from shared.sampling_params import SamplingParams

TEXT = (Path(__file__).resolve().parents[1] / "data" / "english.txt").read_text()


def test_teacher_forced_logits_match_transformers(engine, hf_model, hf_tokenizer):
    ids = hf_tokenizer(TEXT).input_ids[:200]
    assert len(ids) == 200
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()               # [200, V]
    ours = engine.score(ids)                                                 # [200, V]
    diff = (ours - ref).abs().max().item()
    print(f"max abs logit difference over 200 tokens: {diff:.3e}")
    assert diff < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_transformers_generate_in_process(engine, chat_prompt_ids, hf_greedy):
    outs = engine.generate(chat_prompt_ids, SamplingParams(temperature=0, max_tokens=48))
    assert [o[0] for o in outs] == hf_greedy


def test_greedy_one_at_a_time_equals_batched(engine, chat_prompt_ids, hf_greedy):
    for ids, ref in zip(chat_prompt_ids, hf_greedy):
        assert engine.generate([ids], SamplingParams(temperature=0, max_tokens=48))[0][0] == ref
    assert engine.block_manager.num_used_blocks == 0
