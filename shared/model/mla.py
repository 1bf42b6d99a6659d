"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache, storing only the compressed KV.

Shapes: T = new tokens in the step, D = hidden, H = query heads, R = kv_lora_rank, Dn = qk_nope_head_dim,
Dr = qk_rope_head_dim, Dv = v_head_dim, Qr = q_lora_rank.

Per token the cache holds ONE "head" of R + Dr numbers: the normalised latent c = kv_a_layernorm(x W_kva)[:R] and
the shared rotated key k_rot. The model declares it with kv_cache_spec() = (1, R + Dr), and K and V are one tensor.

Keys and values are never materialised. With kv_b_proj split per head into W_UK [H, Dn, R] and W_UV [H, Dv, R]:
    k_nope[h] = W_UK[h] c      so  q_nope[h] . k_nope[h] = (W_UK[h]^T q_nope[h]) . c        ("absorbed" query)
    v[h]      = W_UV[h] c      so  sum_p a[h, p] v[h, p] = W_UV[h] (sum_p a[h, p] c_p)
so attention is multi-query attention of q = [W_UK^T q_nope, q_rot] (R + Dr) against the cached [c, k_rot], whose
output's first R numbers are up-projected by W_UV. Decode then reads R + Dr numbers per cached token, not
H (Dn + Dr + Dv). Softmax scale: (Dn + Dr)^-1/2, times mscale(factor, mscale_all_dim)^2 under scaled RoPE.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.llama import KVCache, RMSNorm
from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref
from shared.ops.rope import apply_rope, rope_tables

LATENT_NORM_EPS = 1e-6          # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps (as HF)


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def mla_scaling(cfg: ModelConfig) -> tuple[dict[str, Any] | None, float]:
    """The rope scaling for the rotary tables (yarn's attention factor from mscale / mscale_all_dim, as HF) and the
    softmax scale (Dn + Dr)^-1/2, times mscale(factor, mscale_all_dim)^2 under any scaled RoPE."""
    x, s = cfg.extra, cfg.rope_scaling
    scale = (x["qk_nope_head_dim"] + x["qk_rope_head_dim"]) ** -0.5
    if s:
        factor, m, m_all = s.get("factor", 1.0), s.get("mscale"), s.get("mscale_all_dim")
        if m_all:
            scale *= _mscale(factor, m_all) ** 2
        if s.get("rope_type", s.get("type")) == "yarn" and s.get("attention_factor") is None and m and m_all:
            s = dict(s, attention_factor=_mscale(factor, m) / _mscale(factor, m_all))
    return s, scale


def mla_rope_tables(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_len, Dr] for the rotary part of q and k."""
    return rope_tables(cfg.extra["qk_rope_head_dim"], cfg.rope_theta, max_len, mla_scaling(cfg)[0])


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs stored (x0, x1), (x2, x3), ... -> rotate-half order (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        x = cfg.extra
        d, self.h = cfg.hidden_size, cfg.num_heads
        self.r, self.dn, self.dr, self.dv = x["kv_lora_rank"], x["qk_nope_head_dim"], x["qk_rope_head_dim"], \
            x["v_head_dim"]
        qr, bias = x.get("q_lora_rank"), cfg.attention_bias
        dq = self.h * (self.dn + self.dr)
        if qr:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, qr, bias=bias)
            self.q_a_layernorm = RMSNorm(qr, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(qr, dq, bias=False)
        else:
            self.q_proj = nn.Linear(d, dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, d, bias=bias)
        self.interleaved = x.get("rope_interleave", True)
        self.scale = mla_scaling(cfg)[1]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """x [T, D]; cos / sin [T, Dr]; kv[0] (also kv[1]) [NB, BS, 1, R + Dr] -> [T, D]."""
        t = x.shape[0]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, self.h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)  # [T, H, Dn|Dr]
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)                 # [T, R], [T, Dr]
        c = self.kv_a_layernorm(c)
        if self.interleaved:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot = apply_rope(q_rot, cos, sin)                                 # [T, H, Dr]
        k_rot = apply_rope(k_rot[:, None], cos, sin)                        # [T, 1, Dr]
        latent = torch.cat([c[:, None], k_rot], dim=-1)                     # [T, 1, R + Dr]
        cache = kv[0]
        cache.view(-1, 1, self.r + self.dr).index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))

        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r)   # [H, Dn + Dv, R]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w[:, :self.dn])        # [T, H, R]  absorbed W_UK
        # The torch reference on every device: the Triton kernel is tuned for per-head K/V, not H queries x 576 dims.
        o = paged_attention_ref(torch.cat([q_lat, q_rot], dim=-1), cache, cache, meta, self.scale)  # [T, H, R + Dr]
        o = torch.einsum("thr,hvr->thv", o[..., :self.r], w[:, self.dn:])   # [T, H, Dv]  W_UV
        return self.o_proj(o.reshape(t, self.h * self.dv))
