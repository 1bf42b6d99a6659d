"""A tiny random Llama checkpoint for tests: saved as a Hugging Face folder, with the prompts the speculative tests
decode and an EAGLE head for it. Used by the parity, unit and integration tests alike."""
from __future__ import annotations

from pathlib import Path

import torch

# prompts of random token ids in the tiny model's vocab (96), of assorted lengths
PROMPTS = [torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 17, 30, 9, 12, 40, 3, 22)]


def save_tiny(path: str | Path, rope: dict | None, tie: bool = True):
    """A 2-layer Llama (vocab 96, hidden 64) with `rope` parameters (None: default RoPE) saved at `path`; returns
    the transformers model (the reference)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=95, bos_token_id=0)
    if rope:
        cfg.rope_parameters = dict(rope, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                         # make logits spread out so greedy ties are unlikely
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    return model


def save_tiny_eagle(target: str | Path, folder: str | Path) -> str:
    """A random EAGLE head for the tiny target at `target` (a reduced vocab of 48 of its 96 tokens), saved in
    `folder`; returns the folder."""
    from shared.model.loader import load_config
    from shared.spec.eagle import EagleHead, head_config_for
    torch.manual_seed(0)
    head = EagleHead(head_config_for(load_config(str(target)), 48))
    head.id_map = torch.randperm(96)[:48].sort().values
    head.save(str(folder))
    return str(folder)
