"""Tiny random MoE checkpoints of each family, saved as Hugging Face folders: our loader, routing, experts and (for
DeepSeek-V3) latent attention over the paged cache against transformers, teacher-forced and greedy."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams

COMMON = {"vocab_size": 112, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
          "eos_token_id": 111, "bos_token_id": 0}


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                            num_experts_per_tok=2))


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, head_dim=24, intermediate_size=96, moe_intermediate_size=32,
                                              num_experts=6, num_experts_per_tok=2, norm_topk_prob=True))


def _deepseek_v3(**over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    # transformers' MLA wants as many kv heads as query heads
    kw = dict(COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
              routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=12)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**dict(kw, **over)))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():                   # selection-only bias, on the scale of the sigmoid scores' spread
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.05)
    return model


def _deepseek_v3_yarn():
    return _deepseek_v3(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8})


FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def save_tiny(path, family):
    torch.manual_seed(0)
    model = FAMILIES.get(family, _deepseek_v3_yarn)().eval()
    with torch.no_grad():                   # spread the logits so greedy ties are unlikely
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    return model


def _engine(path):
    return LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, block_size=16))


def _logits_diff(ref, eng, n=120):
    ids = torch.randint(1, 110, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    return ids, (eng.score(ids) - expect).abs().max().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_match_transformers(tmp_path, family):
    ref = save_tiny(tmp_path, family)
    eng = _engine(tmp_path)
    ids, diff = _logits_diff(ref, eng)
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4
    prompts = [ids[:20], ids[40:47]]        # decoded together: batched routing and paged attention
    expect = []
    for p in prompts:
        with torch.inference_mode():
            g = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             temperature=None, top_p=None, top_k=None)
        expect.append(g[0, len(p):].tolist())
    out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o[0] for o in out] == expect


def test_deepseek_v3_caches_one_latent_per_token(tmp_path):
    """No q LoRA, non-interleaved RoPE, yarn with mscale: the latent cache is one tensor for K and V."""
    ref = save_tiny(tmp_path, "deepseek_v3_yarn")
    eng = _engine(tmp_path)
    k, v = eng.runner.kv_caches[0]
    assert k is v and tuple(k.shape) == (64, 16, 1, 32 + 8)
    _, diff = _logits_diff(ref, eng)
    print(f"deepseek_v3 (yarn, no q LoRA): max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4
