"""DeepSeek-V3: multi-head latent attention (shared.model.mla) in every layer; a dense SwiGLU in the first
`first_k_dense_replace` layers and a MoE block after them.

MoE: sigmoid router scores, `e_score_correction_bias` added only to choose experts, group-limited top-k (n_group,
topk_group), weights renormalised (norm_topk_prob) and scaled by routed_scaling_factor, plus n_shared_experts
always-on experts fused into one MLP of n_shared_experts * moe_intermediate_size.

The paged cache holds the compressed latent (kv_cache_spec), one tensor per layer for K and V. Layers past
num_hidden_layers in the checkpoint (the multi-token-prediction head) are skipped.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from shared.model.config import ModelConfig
from shared.model.llama import DecoderLayer
from shared.model.mla import MLAttention, mla_rope_tables
from shared.model.moe import MoEBlock, MoECausalLM, RoutingConfig


class DeepseekV3ForCausalLM(MoECausalLM):
    _RENAMES = ((".shared_experts.", ".shared_expert."),)
    # Only the MLPs fuse rows: MLA's q_proj is not Llama's qkv_proj.
    _FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    kv_cache_shared = True                                  # K and V of the cache are one latent tensor

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        x = cfg.extra
        experts = x.get("n_routed_experts", x.get("num_local_experts"))
        self.routing = RoutingConfig(
            "sigmoid_group_topk", experts, x["num_experts_per_tok"], renormalize=bool(x.get("norm_topk_prob", True)),
            n_group=x.get("n_group") or 1, topk_group=x.get("topk_group") or 1,
            scaling_factor=float(x.get("routed_scaling_factor", 1.0)), fp32_logits=True)
        self.max_len = max_len
        super().__init__(cfg, max_len)
        self.rope_cos, self.rope_sin = mla_rope_tables(cfg, max_len)   # [P, Dr]

    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        x = self.cfg.extra
        layer.self_attn = MLAttention(self.cfg)
        if i >= x.get("first_k_dense_replace", 0):
            inter = x["moe_intermediate_size"]
            layer.mlp = MoEBlock(i, self.cfg.hidden_size, inter, self.routing,
                                 shared_inter=inter * x.get("n_shared_experts", 0), correction_bias=True)

    def kv_cache_spec(self) -> tuple[int, int]:
        """(kv heads, head dim) of one layer's paged cache: one latent "head" of kv_lora_rank + qk_rope_head_dim."""
        x = self.cfg.extra
        return 1, x["kv_lora_rank"] + x["qk_rope_head_dim"]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        # build_model fills the RoPE tables from cfg.head_dim; MLA rotates only qk_rope_head_dim dims.
        self.rope_cos, self.rope_sin = mla_rope_tables(self.cfg, self.max_len)
