"""Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`): the Llama skeleton with Gemma's pieces.

- RMSNorm scales by (1 + w), in fp32 before the cast (Llama casts first, then multiplies by w).
- The embeddings are multiplied by sqrt(hidden), rounded to the model's dtype.
- Four norms a layer: before and after attention, before and after the MLP (the outputs of attention and MLP are
  normed before they join the residual stream).
- The MLP is GELU (tanh approximation) of gate, times up.
- Attention scales scores by query_pre_attn_scalar^-0.5; local (sliding-window) and global layers alternate as
  `layer_types` says. Gemma 2 soft-caps the scores (cap tanh(s / cap), computed by the torch reference attention)
  and the final logits; Gemma 3 normalises each head's q and k (Gemma's RMSNorm) and gives its local layers their
  own RoPE base (`rope_parameters["sliding_attention"]`).
Shapes: T = tokens, H / KVH = query / kv heads, Dh = head dim, D = hidden, I = intermediate, V = vocab.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig
from shared.model.llama import MLP, Attention, KVCache, LlamaForCausalLM
from shared.ops.attention import paged_attention
from shared.ops.paged_attention import AttentionMetadata, write_kv
from shared.ops.rope import apply_rope, rope_tables


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)                # [T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(Attention):
    """Scores scaled by query_pre_attn_scalar^-0.5; Gemma 2's soft cap; Gemma 3's per-head q / k norms."""

    def __init__(self, cfg: ModelConfig, window: int | None, qk_norm: bool) -> None:
        super().__init__(cfg, window)
        x = cfg.extra
        self.scale = float(x.get("query_pre_attn_scalar") or self.dh) ** -0.5
        self.softcap = x.get("attn_logit_softcapping") or None
        self.q_norm = GemmaRMSNorm(self.dh, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.dh, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.dh, self.kvh * self.dh, self.kvh * self.dh], dim=-1)
        q, k = q.reshape(t, self.h, self.dh), k.reshape(t, self.kvh, self.dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)                # [T, H, Dh], [T, KVH, Dh]
        write_kv(kv[0], kv[1], k, v.reshape(t, self.kvh, self.dh), meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, self.window, self.softcap)   # [T, H, Dh]
        return self.o_proj(o.reshape(t, self.h * self.dh))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, qk_norm: bool) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, window, qk_norm)
        self.mlp = GemmaMLP(d, cfg.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Gemma(LlamaForCausalLM):
    QK_NORM = False

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        if cfg.extra.get("use_bidirectional_attention"):
            raise ValueError(f"{cfg.architecture}: bidirectional attention (an embedding model) is not served")
        super().__init__(cfg, max_len)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.max_len = max_len
        self.final_softcap = cfg.extra.get("final_logit_softcapping") or None

    def decoder_layer(self, cfg: ModelConfig, window: int | None) -> nn.Module:
        return GemmaDecoderLayer(cfg, window, self.QK_NORM)

    def rope_for(self, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, Dh] of layer's RoPE at positions."""
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                         # [T, D]
        x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        tables: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            key = self.rope_key(i)
            if key not in tables:
                tables[key] = self.rope_for(i, positions, x.dtype)
            x = layer(x, *tables[key], meta, kv)
        return self.norm(x)

    def rope_key(self, layer: int) -> int | None:
        return None                                                              # one table for every layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)                                  # [N, V] fp32
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma2ForCausalLM(_Gemma):
    pass


class Gemma3ForCausalLM(_Gemma):
    """Gemma 3's text model: local layers take the RoPE of rope_parameters["sliding_attention"], global ones that
    of "full_attention" (its scaling included)."""
    QK_NORM = True

    def rope_key(self, layer: int) -> int | None:
        return 1 if self.layers[layer].self_attn.window else 0

    def rope_for(self, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "_tables", None) is None or self._tables[0][0].device != positions.device:
            params = self.cfg.extra.get("rope_parameters") or {}
            tables = []
            for kind in ("full_attention", "sliding_attention"):
                p = params.get(kind) or {}
                theta = p.get("rope_theta") or self.cfg.extra.get(
                    "rope_local_base_freq" if kind == "sliding_attention" else "rope_theta") or 10000.0
                scaling = p if p.get("rope_type", "default") != "default" else None
                cos, sin = rope_tables(self.cfg.head_dim, float(theta), self.max_len, scaling)
                tables.append((cos.to(positions.device), sin.to(positions.device)))
            self._tables = tables
        cos, sin = self._tables[self.rope_key(layer)]
        return cos[positions].to(dtype), sin[positions].to(dtype)
