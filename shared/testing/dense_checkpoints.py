"""Tiny random checkpoints of the dense families Upesi serves (Llama 3, Qwen 2 / 3, Phi-3 / Phi-4-mini, Gemma 2 / 3,
Mistral), made with transformers' config classes, for the parity and stack tests."""
from __future__ import annotations

from pathlib import Path

import torch

from shared.testing.moe_checkpoints import COMMON

PROMPTS = [[5, 17, 29, 3, 77, 41, 8, 60, 12, 99, 5, 17, 29], [9, 2, 64, 13]]


def make_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, intermediate_size=96))


def make_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24, intermediate_size=96))


def make_phi3(window: int | None = 16, longrope: bool = False, rotary: float = 1.0):
    from transformers import Phi3Config, Phi3ForCausalLM
    extra = {}
    heads = COMMON["num_attention_heads"] if rotary == 1.0 else 2       # Phi-4-mini-like: 32-dim heads, half rotated
    if longrope:                            # the 128k variants' scaling, past an original window of 32 positions
        half = int(COMMON["hidden_size"] // heads * rotary) // 2
        extra = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                  "long_factor": [2.0 + i for i in range(half)]},
                 "original_max_position_embeddings": 32}
    return Phi3ForCausalLM(Phi3Config(**(COMMON | {"num_attention_heads": heads}), intermediate_size=96,
                                      sliding_window=window, pad_token_id=None, partial_rotary_factor=rotary, **extra))


GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def make_gemma2(**kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(**(COMMON | GEMMA | kw), intermediate_size=96, attn_logit_softcapping=5.0,
                                          final_logit_softcapping=3.0))


def make_gemma3(local_theta: float = 100.0, **kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return Gemma3ForCausalLM(Gemma3TextConfig(**(COMMON | GEMMA | kw), intermediate_size=96, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}))


def make_gemma3_multimodal():
    """Gemma 3 4B and up: a Gemma3ForConditionalGeneration checkpoint (SigLIP vision tower, projector), served for
    its text; transformers runs the same wrapper on text-only input."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    text = Gemma3TextConfig(**(COMMON | GEMMA), intermediate_size=96)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))


def make_llama3():
    """Llama 3.x: its RoPE scaling (low / high frequency factors over an original window of 32 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=96, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}))


def make_mistral(window: int | None):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**COMMON, intermediate_size=96, sliding_window=window))


def save_dense(make, path: str | Path):
    """The model `make()` builds, seeded, its logits spread, saved at `path`; returns it (the reference)."""
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():                   # spread the logits so greedy ties are unlikely
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    return model


MAKERS = {"llama3": make_llama3, "qwen2": make_qwen2, "qwen3": make_qwen3, "phi3": make_phi3,
          "phi3_longrope": lambda: make_phi3(None, True), "phi4_mini": lambda: make_phi3(None, True, 0.5),
          "gemma2": make_gemma2, "gemma3": make_gemma3, "gemma3_multimodal": make_gemma3_multimodal}
