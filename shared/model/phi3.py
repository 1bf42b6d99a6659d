"""Phi-3, Phi-3.5-mini and Phi-4-mini (`phi3`): the Llama decoder.

Their checkpoints hold q, k and v in one `qkv_proj` and gate and up in one `gate_up_proj` (gate first), the layout
this code's layers already have; the loader splits them back into the names the Llama loader knows. The sliding
window of the config (2047 in Phi-3-mini-4k) applies on every layer. LongRoPE (the 128k variants): the short factors
within the original window and, past it, the long factors as transformers switches to them (shared.ops.rope,
LLMEngine._switch_long_rope). A partial rotary factor (Phi-4-mini's 0.75) rotates that share of each head's dims
(ModelConfig.rotary_dim).
Shapes: H / KVH = query / kv heads, Dh = head dim, I = intermediate size, D = hidden.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def split_fused(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's fused qkv_proj [(H + 2 KVH) Dh, D] and gate_up_proj [2I, D] (gate first) as the Llama
        names q/k/v_proj and gate/up_proj (also what `upesi quantize` reads, so each gets its own NVFP4 scales)."""
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, w in weights:
            if name.endswith("self_attn.qkv_proj.weight"):
                for part, t in zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv])):
                    yield name.replace("qkv_proj", part), t
            elif name.endswith("mlp.gate_up_proj.weight"):
                for part, t in zip(("gate_proj", "up_proj"), w.chunk(2)):
                    yield name.replace("gate_up_proj", part), t
            else:
                yield name, w

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.split_fused(weights, self.cfg))
