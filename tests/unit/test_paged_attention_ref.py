"""The reference's grouped-query attention (query heads folded per KV head) against SDPA's own enable_gqa."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.ops.paged_attention import gqa_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,kvh,nq,length", [(1, 9, 3, 1, 37), (3, 9, 3, 1, 20), (1, 9, 3, 9, 50), (2, 8, 2, 5, 16),
                                               (1, 4, 4, 3, 10), (1, 16, 1, 4, 12)])
def test_grouped_sdpa_equals_enable_gqa(dtype, b, h, kvh, nq, length):
    g = torch.Generator().manual_seed(b * 100 + h + nq)
    q = torch.randn(b, h, nq, 64, generator=g).to(dtype)
    k, v = (torch.randn(b, kvh, length, 64, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(b, 1, nq, length, generator=g) < 0.7
    mask[..., 0] = True                                          # no row fully masked
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(gqa_attention(q, k, v, mask, 0.125), want, atol=tol, rtol=tol)
    if nq == length or nq == 1:
        return
    k, v = k[:, :, :nq], v[:, :, :nq]                             # causal: Q = L
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(gqa_attention(q, k, v, None, 0.125, causal=True), want, atol=tol, rtol=tol)
