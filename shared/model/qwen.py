"""Qwen2 / Qwen2.5 and Qwen3 (dense): the Llama decoder with Qwen's attention.

Qwen2: a bias on q, k and v (none on o). Qwen3: RMSNorm over each head's q and k before RoPE, an explicit head_dim,
biases only where `attention_bias` says. Both carry a sliding-window option (`use_sliding_window`, off in the
released checkpoints), served on the layers the config names (shared.model.llama.layer_windows). The MoE variants
(shared.model.qwen_moe) use the same attention. Shapes: T = tokens, H / KVH = query / kv heads, Dh = head dim.
"""
from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.llama import Attention, KVCache, LlamaForCausalLM, RMSNorm
from shared.ops.attention import paged_attention
from shared.ops.paged_attention import AttentionMetadata, write_kv
from shared.ops.rope import apply_rope


class QKVBiasAttention(Attention):
    """Llama attention with a bias on q/k/v only (Qwen2)."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool, window: int | None = None) -> None:
        super().__init__(cfg, window)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.dh, bias=qkv_bias)
        self.o_proj = nn.Linear(self.h * self.dh, cfg.hidden_size, bias=False)


class QKNormAttention(Attention):
    """Llama attention with per-head RMSNorm on q and k before RoPE (Qwen3)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__(cfg, window)
        self.q_norm = RMSNorm(self.dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.dh, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.dh, self.kvh * self.dh, self.kvh * self.dh], dim=-1)
        q = apply_rope(self.q_norm(q.view(t, self.h, self.dh)), cos, sin)      # [T, H, Dh]
        k = apply_rope(self.k_norm(k.view(t, self.kvh, self.dh)), cos, sin)    # [T, KVH, Dh]
        write_kv(kv[0], kv[1], k, v.view(t, self.kvh, self.dh), meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, self.window)     # [T, H, Dh]
        return self.o_proj(o.reshape(t, self.h * self.dh))


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        for layer in self.layers:
            layer.self_attn = QKVBiasAttention(cfg, qkv_bias=True, window=layer.self_attn.window)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        for layer in self.layers:
            layer.self_attn = QKNormAttention(cfg, window=layer.self_attn.window)
