"""A long prompt (9,000 tokens) on a tiny long-context Llama (16,384 positions, head size 64) against transformers:
fp32 teacher-forced logits within fp32 accumulation error, and greedy output through chunked prefill equal to
transformers' generate; in bf16, the prefill attention kernel (AMX where the CPU has it) against torch's SDPA on the
same bf16 engine."""
from __future__ import annotations

import pytest
import torch

from shared.sampling_params import SamplingParams

LENGTH = 9000
BLOCKS = (LENGTH + 64) // 16 + 8


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                      rope_theta=500000.0, tie_word_embeddings=True, eos_token_id=95, bos_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                         # spread the logits so that greedy ties are unlikely
        model.lm_head.weight.mul_(8)
    path = tmp_path_factory.mktemp("long-llama")
    model.save_pretrained(path)
    return str(path), model


def engine(path: str, dtype: str, **kw):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=path, dtype=dtype, num_kv_blocks=BLOCKS, progress=False, **kw))


def prompt() -> list[int]:
    return torch.randint(1, 95, (LENGTH,), generator=torch.Generator().manual_seed(9)).tolist()


def test_fp32_logits_and_greedy_of_a_long_prompt_match_transformers(long_llama):
    path, ref_model = long_llama
    ids = prompt()
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0].float()                      # [T, V]
        want = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, LENGTH:].tolist()
    eng = engine(path, "float32", prefill_chunk_tokens=2048)
    ours = eng.score(ids)                                                             # [T, V]
    diff = (ours - ref).abs().max().item()
    print(f"max abs logit difference over {LENGTH} positions: {diff:.2e}")
    assert diff < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    got = eng.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0][0]
    assert got == want                                                # the prompt in chunks of 2,048 and 512
    assert eng.block_manager.num_used_blocks == 0


def test_bf16_prefill_kernel_agrees_with_torch_attention(long_llama, monkeypatch):
    from shared.ops import prefill_attention
    if not prefill_attention.available(64):
        pytest.skip("no prefill kernel on this CPU (AMX or AVX512-BF16): bf16 prefill runs torch's SDPA only")
    path, _ = long_llama
    ids = prompt()
    eng = engine(path, "bfloat16")
    kernel = eng.score(ids)
    monkeypatch.setattr(prefill_attention, "available", lambda head_dim: False)
    torch_path = eng.score(ids)
    diff = (kernel - torch_path).abs().max().item()
    agree = (kernel.argmax(-1) == torch_path.argmax(-1)).float().mean().item()
    print(f"bf16, kernel against SDPA: max abs logit difference {diff:.3f}, argmax agreement {agree:.4f}")
    assert diff < 0.25 * torch_path.abs().max().item() and agree > 0.99
