"""Picks the paged-attention implementation for the device: the Triton kernel on GPU, the torch reference on CPU."""
from __future__ import annotations

import torch

from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [T, H, Dh] against the paged cache -> [T, H, Dh]."""
    if q.is_cuda and not meta.tree_masks:        # draft trees: the reference's masks (the kernel is causal only)
        from shared.ops.paged_attention_triton import paged_attention_triton   # imported only where it runs
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
