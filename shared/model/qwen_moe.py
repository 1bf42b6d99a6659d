"""Qwen2-MoE and Qwen3-MoE: Llama-shaped decoders whose feed-forward is sparse in the layers picked by
`decoder_sparse_step` and not listed in `mlp_only_layers` (the others keep a dense SwiGLU of intermediate_size).

Routing: softmax top-k, renormalised only when `norm_topk_prob`.
Qwen2-MoE: q/k/v carry a bias (`qkv_bias`, o_proj has none); a shared expert gated per token by
sigmoid(shared_expert_gate(x)) is added to the routed experts.
Qwen3-MoE: no shared expert; RMSNorm over each head's q and k (`q_norm`, `k_norm`) before RoPE; explicit head_dim.

Shapes: T = tokens, H / KVH = query / kv heads, Dh = head dim.
"""
from __future__ import annotations

from shared.model.config import ModelConfig
from shared.model.llama import DecoderLayer
from shared.model.moe import MoEBlock, MoECausalLM, RoutingConfig
from shared.model.qwen import QKNormAttention, QKVBiasAttention


class _QwenMoE(MoECausalLM):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
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
        layer.self_attn = QKVBiasAttention(self.cfg, x.get("qkv_bias", True), window=layer.self_attn.window)
        if self.is_sparse(i):
            layer.mlp = MoEBlock(i, self.cfg.hidden_size, x["moe_intermediate_size"], self.routing,
                                 shared_inter=x.get("shared_expert_intermediate_size", 0), shared_gate=True)


class Qwen3MoeForCausalLM(_QwenMoE):
    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        layer.self_attn = QKNormAttention(self.cfg, window=layer.self_attn.window)
        if self.is_sparse(i):
            layer.mlp = MoEBlock(i, self.cfg.hidden_size, self.cfg.extra["moe_intermediate_size"], self.routing)
