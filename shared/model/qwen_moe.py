"""Qwen2-MoE and Qwen3-MoE: Llama-shaped decoders whose feed-forward is sparse in the layers picked by
`decoder_sparse_step` and not listed in `mlp_only_layers` (the others keep a dense SwiGLU of intermediate_size).

Routing: softmax top-k, renormalised only when `norm_topk_prob`.
Qwen2-MoE: q/k/v carry a bias (`qkv_bias`, o_proj has none); a shared expert gated per token by
sigmoid(shared_expert_gate(x)) is added to the routed experts.
Qwen3-MoE: no shared expert; RMSNorm over each head's q and k (`q_norm`, `k_norm`) before RoPE; explicit head_dim.

Shapes: T = tokens, H / KVH = query / kv heads, Dh = head dim.
"""
from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.llama import Attention, DecoderLayer, KVCache, RMSNorm
from shared.model.moe import MoEBlock, MoECausalLM, RoutingConfig, reject_sliding_window
from shared.ops.attention import paged_attention
from shared.ops.paged_attention import AttentionMetadata, write_kv
from shared.ops.rope import apply_rope


class QKVBiasAttention(Attention):
    """Llama attention with a bias on q/k/v only (Qwen2)."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool) -> None:
        super().__init__(cfg)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.dh, bias=qkv_bias)
        self.o_proj = nn.Linear(self.h * self.dh, cfg.hidden_size, bias=False)


class QKNormAttention(Attention):
    """Llama attention with per-head RMSNorm on q and k before RoPE (Qwen3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(self.dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.dh, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.dh, self.kvh * self.dh, self.kvh * self.dh], dim=-1)
        q = apply_rope(self.q_norm(q.view(t, self.h, self.dh)), cos, sin)      # [T, H, Dh]
        k = apply_rope(self.k_norm(k.view(t, self.kvh, self.dh)), cos, sin)    # [T, KVH, Dh]
        write_kv(kv[0], kv[1], k, v.view(t, self.kvh, self.dh), meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale)                  # [T, H, Dh]
        return self.o_proj(o.reshape(t, self.h * self.dh))


class _QwenMoE(MoECausalLM):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        reject_sliding_window(cfg, max_len)
        x = cfg.extra
        self.num_experts = x.get("num_experts", x.get("num_local_experts", 0))
        self.routing = RoutingConfig("softmax_topk", self.num_experts, x["num_experts_per_tok"],
                                     renormalize=bool(x.get("norm_topk_prob", False))) if self.num_experts else None
        super().__init__(cfg, max_len)

    def is_sparse(self, i: int) -> bool:
        x = self.cfg.extra
        return (i not in (x.get("mlp_only_layers") or []) and self.num_experts > 0
                and (i + 1) % x.get("decoder_sparse_step", 1) == 0)


class Qwen2MoeForCausalLM(_QwenMoE):
    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        x = self.cfg.extra
        layer.self_attn = QKVBiasAttention(self.cfg, x.get("qkv_bias", True))
        if self.is_sparse(i):
            layer.mlp = MoEBlock(i, self.cfg.hidden_size, x["moe_intermediate_size"], self.routing,
                                 shared_inter=x.get("shared_expert_intermediate_size", 0), shared_gate=True)


class Qwen3MoeForCausalLM(_QwenMoE):
    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        layer.self_attn = QKNormAttention(self.cfg)
        if self.is_sparse(i):
            layer.mlp = MoEBlock(i, self.cfg.hidden_size, self.cfg.extra["moe_intermediate_size"], self.routing)
