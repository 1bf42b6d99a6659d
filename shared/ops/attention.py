"""Picks the paged-attention implementation for the device: the Triton kernel on GPU; on CPU the C kernel
(shared.ops.cpu_attention) where it runs, else the torch reference."""
from __future__ import annotations

import torch

from shared.ops import cpu_attention
from shared.ops.paged_attention import MAX_TREE, AttentionMetadata, paged_attention_ref


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, Dh] against the paged cache -> [T, H, Dh]; `window`: a sliding window of that many positions;
    `softcap`: Gemma 2's soft-capped scores (softcap tanh(s / softcap))."""
    if q.is_cuda and all(m.shape[0] <= MAX_TREE for m in meta.tree_masks.values()):   # bigger trees: the reference
        from shared.ops.paged_attention_triton import paged_attention_triton  # imported only where it runs
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    if cpu_attention.supports(q, k_cache):
        return cpu_attention.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, window, softcap)
