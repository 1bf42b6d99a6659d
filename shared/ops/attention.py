"""Picks the paged-attention implementation for the device: the Triton kernel on GPU, the torch reference on CPU."""
from __future__ import annotations

import torch

from shared.ops.paged_attention import MAX_TREE, AttentionMetadata, paged_attention_ref


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [T, H, Dh] against the paged cache -> [T, H, Dh]."""
    if q.is_cuda and all(m.shape[0] <= MAX_TREE for m in meta.tree_masks.values()):   # bigger trees: the reference
        from shared.ops.paged_attention_triton import paged_attention_triton   # imported only where it runs
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
