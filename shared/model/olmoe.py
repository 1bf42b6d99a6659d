"""OLMoE (`olmoe`): a Llama-shaped decoder whose every feed-forward is a sparse MoE (64 experts, top 8 in the
released model), routed by softmax top-k, renormalised only when `norm_topk_prob`; no shared expert.

Its attention normalises q and k over their whole projections (all heads together, RMSNorm of H Dh and KVH Dh
features) before RoPE, and clamps q, k and v to +-clip_qkv where the config sets it.
Checkpoint names: `mlp.gate` is the router, `mlp.experts.{e}.gate_proj / up_proj / down_proj` an expert.
Shapes: T = tokens, H / KVH = query / kv heads, Dh = head dim.
"""
from __future__ import annotations

import torch

from shared.model.config import ModelConfig
from shared.model.llama import Attention, DecoderLayer, KVCache, RMSNorm
from shared.model.moe import MoEBlock, MoECausalLM, RoutingConfig
from shared.ops.attention import paged_attention
from shared.ops.paged_attention import AttentionMetadata, write_kv
from shared.ops.rope import apply_rope


class WholeQKNormAttention(Attention):
    """Llama attention with RMSNorm over the whole q and k projections before RoPE, and an optional clamp."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__(cfg, window)
        self.q_norm = RMSNorm(self.h * self.dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kvh * self.dh, cfg.rms_norm_eps)
        self.clip = cfg.extra.get("clip_qkv")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.dh, self.kvh * self.dh, self.kvh * self.dh], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)                                   # [T, H Dh], [T, KVH Dh]
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q = apply_rope(q.reshape(t, self.h, self.dh), cos, sin)                 # [T, H, Dh]
        k = apply_rope(k.reshape(t, self.kvh, self.dh), cos, sin)               # [T, KVH, Dh]
        write_kv(kv[0], kv[1], k, v.reshape(t, self.kvh, self.dh), meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, self.window)     # [T, H, Dh]
        return self.o_proj(o.reshape(t, self.h * self.dh))


class OlmoeForCausalLM(MoECausalLM):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        x = cfg.extra
        self.routing = RoutingConfig("softmax_topk", x["num_experts"], x["num_experts_per_tok"],
                                     renormalize=bool(x.get("norm_topk_prob", False)))
        super().__init__(cfg, max_len)

    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        layer.self_attn = WholeQKNormAttention(self.cfg, window=layer.self_attn.window)
        layer.mlp = MoEBlock(i, self.cfg.hidden_size, self.cfg.intermediate_size, self.routing)
