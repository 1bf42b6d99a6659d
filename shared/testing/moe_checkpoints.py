"""Tiny random MoE checkpoints of the five families, built with transformers' own config classes and saved as
Hugging Face folders, and transformers' greedy continuations of them: shared by the parity, expert-shard,
rebalancing and NVFP4 tests, with the `upesi experts` processes those start.

Every family has at least 4 routed experts, top-2 or more, at least 2 MoE layers, and its shared experts where it
has them:
    mixtral      3 MoE layers, 4 experts
    qwen2_moe    layers 0 and 2 MoE (4 experts + a sigmoid-gated shared expert), layer 1 dense
    qwen3_moe    3 MoE layers, 6 experts, norm_topk_prob
    deepseek_v3  layer 0 dense, layers 1 and 2 MoE (8 experts in 2 groups, 1 shared expert), MLA attention
    olmoe        3 MoE layers, 64 experts, top 8, no renormalisation, q/k normed over their whole projections
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from shared.testing.stack import ROOT

COMMON = {"vocab_size": 112, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
          "eos_token_id": 111, "bos_token_id": 0}
PROMPTS = [[5, 17, 29, 3, 77, 41, 8, 60, 12, 99], [9, 2, 64, 13]]     # decoded together: batched routing


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


def _deepseek_v3(skew: float = 0.0, **over):
    """skew > 0 adds it to the selection-only correction bias of experts 0 and 1: every token then picks them (both
    on shard 0 of a contiguous 2-shard placement), the skewed workload of the rebalancing test."""
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
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(8, generator=g) * 0.05)
            bias[:2] += skew
    return model


def _deepseek_v3_yarn():
    return _deepseek_v3(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8})


def _deepseek_v3_skewed():
    return _deepseek_v3(skew=10.0)


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(**COMMON, intermediate_size=16, num_experts=64, num_experts_per_tok=8,
                                        norm_topk_prob=False))


FAMILIES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3,
            "olmoe": _olmoe}
VARIANTS = {**FAMILIES, "deepseek_v3_yarn": _deepseek_v3_yarn, "deepseek_v3_skewed": _deepseek_v3_skewed}


def save_tiny(path: str | Path, family: str):
    """Builds the family's tiny model (seeded), saves it to `path` and returns it (eval mode, fp32)."""
    torch.manual_seed(0)
    model = VARIANTS[family]().eval()
    with torch.no_grad():                   # spread the logits so greedy ties are unlikely
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    return model


def save_tokenizer(path: str | Path) -> None:
    """A word-level tokenizer for the tiny vocabulary ("t1" .. "t110" are ids 1 .. 110, <s> 0, </s> 111), so the
    router can serve a tiny checkpoint: the text "t5 t17" is the prompt [5, 17]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<s>": 0, **{f"t{i}": i for i in range(1, 111)}, "</s>": 111}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")                      # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def stack_greedy(address: str, prompts: list[list[int]], tokens: int, k: int) -> list[list[int]]:
    """Greedy token ids of each prompt through a running router's Generate (prompts as save_tokenizer's words),
    with num_speculative_tokens = k."""
    import grpc

    from upesi.v1 import generation_pb2 as pb
    from upesi.v1 import generation_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return [list(stub.Generate(pb.GenerateRequest(prompt=" ".join(f"t{i}" for i in p), max_tokens=tokens,
                                                      temperature=0, ignore_eos=True, num_speculative_tokens=k),
                                   timeout=120).choices[0].token_ids) for p in prompts]


def hf_greedy(model, prompts: list[list[int]] = PROMPTS, tokens: int = 32) -> list[list[int]]:
    """transformers' `generate`, greedy, `tokens` new tokens of each prompt (EOS ignored)."""
    out = []
    for p in prompts:
        with torch.inference_mode():
            ids = torch.tensor([p])        # no padding: a config's pad_token_id (OLMoE's is 1) must not mask a token
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                               eos_token_id=None, temperature=None, top_p=None, top_k=None)
        out.append(g[0, len(p):].tolist())
    return out


def start_shard(model: str, index: int, n: int, address: str, log, placement: str | None = None,
                extra: tuple[str, ...] = ()) -> subprocess.Popen:
    more = ["--expert-placement", placement] if placement else []
    return subprocess.Popen([sys.executable, "-m", "services.cli", "experts", "--model", model, "--address", address,
                             "--shard-index", str(index), "--num-shards", str(n), "--num-threads", "1", *more, *extra],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
