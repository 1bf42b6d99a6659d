"""Rotary position embeddings with the scaling variants found in Hugging Face configs.

Shapes: T = tokens in the step, H = heads, Dh = head dim.
Uses the "rotate half" convention of HF checkpoints (GGUF q/k weights are un-permuted to it at load).
"""
from __future__ import annotations

import math
from typing import Any

import torch


def _default(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))   # [Dh/2]


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return torch.where(is_mid, mid, scaled)


def _yarn(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast", 32.0), s.get("beta_slow", 1.0)
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    pos = _default(dim, base)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (pos / factor) * (1 - extrapolation) + pos * extrapolation
    return inv, mscale


def _longrope(dim: int, base: float, s: dict[str, Any], which: str) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: the `which` ("short_factor" or "long_factor") factors divide the frequencies, and the
    attention factor (from the ratio of the windows unless given) scales cos and sin."""
    old = s["original_max_position_embeddings"]
    factor = s.get("factor") or (s.get("max_position_embeddings") or old) / old
    mscale = s.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1 else 1.0)
    ext = torch.tensor(s[which], dtype=torch.float64)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), mscale


def long_rope_after(scaling: dict[str, Any] | None, max_pos: int) -> int | None:
    """LongRoPE served past its original window: that window, else None. The tables of rope_tables then hold the
    short-factor rows, then as many long-factor rows. transformers computes a sequence on the short factors while
    it fits the window and, once it grows past it, drops its cache and computes everything again on the long
    factors (a prompt longer than the window is on them from the start); the engine does the same
    (LLMEngine._switch_long_rope), and the model reads the long half of the tables for those sequences."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind != "longrope" or max_pos <= scaling["original_max_position_embeddings"]:
        return None
    return scaling["original_max_position_embeddings"]


def rope_tables(head_dim: int, base: float, max_pos: int,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (cos, sin), each [max_pos, Dh], in float32 ([2 max_pos, Dh] for LongRoPE past its original window:
    short-factor rows, then long-factor rows, see long_rope_after). Always computed on the CPU: inside a model built
    on the meta device they would be placeholders, and torch's meta arange loads torch._dynamo (a second of
    start-up)."""
    with torch.device("cpu"):
        if long_rope_after(scaling, max_pos) is not None:
            short = _tables(head_dim, base, max_pos, scaling, "short_factor")
            long = _tables(head_dim, base, max_pos, scaling, "long_factor")
            return torch.cat([short[0], long[0]]), torch.cat([short[1], long[1]])
        return _tables(head_dim, base, max_pos, scaling, "short_factor")


def _tables(head_dim: int, base: float, max_pos: int, scaling: dict[str, Any] | None,
            longrope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_pos, Dh]; `longrope`: the LongRoPE factors to use ("short_factor" or "long_factor")."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    inv, mscale = _default(head_dim, base), 1.0
    pos = torch.arange(max_pos, dtype=torch.float64)
    if kind == "linear":
        pos = pos / scaling["factor"]
    elif kind == "dynamic":
        # NTK-aware: HF rescales the base once the sequence outgrows the original window; we use the
        # scaled base for the whole table when the served window is larger than the original one.
        old = scaling.get("original_max_position_embeddings", max_pos)
        if max_pos > old:
            f = scaling["factor"]
            base = base * ((f * max_pos / old) - (f - 1)) ** (head_dim / (head_dim - 2))
            inv = _default(head_dim, base)
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind == "freq_factors":                            # a GGUF's rope_freqs: each frequency divided by its own
        inv = inv / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "yarn":
        inv, mscale = _yarn(head_dim, base, scaling, max_pos)
    elif kind == "longrope":
        inv, mscale = _longrope(head_dim, base, scaling, longrope)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    freqs = torch.outer(pos, inv)                           # [P, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)                 # [P, Dh]
    return (emb.cos() * mscale).float(), (emb.sin() * mscale).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, Dh]; cos/sin [T, R] already gathered at the tokens' positions. R < Dh (a partial rotary factor, as
    Phi-4-mini's): the first R dims are rotated, the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
