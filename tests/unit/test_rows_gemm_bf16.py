"""The AVX512-BF16 rows kernel (shared/ops/rows_gemm_bf16.c) against an fp32 reference and F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.ops import rows_gemm_bf16 as rg

pytestmark = pytest.mark.skipif(not rg.available(), reason="no AVX512-BF16 (or no compiler) on this machine")


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n,k", [(960, 576), (72, 40), (576, 1536)])
def test_matches_fp32_reference_within_bf16_rounding(m, n, k):
    g = torch.Generator().manual_seed(m * n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    want = x.float() @ w.float().t() + bias.float()
    got = rg.run(x, rg.pack(w), n, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # one rounding of an fp32 sum: within half a bf16 ulp of the fp32 result, plus the sum's own error
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * k ** 0.5).all()
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-2, atol=2e-2)


def test_a_row_does_not_depend_on_its_neighbours():
    """Same bits alone, first, last, or in the middle of a tile of 6 and of a second tile."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(200, 576, generator=g).bfloat16(), torch.randn(13, 576, generator=g).bfloat16()
    panels = rg.pack(w)
    whole = rg.run(x, panels, 200)
    for i in range(13):
        assert torch.equal(rg.run(x[i:i + 1], panels, 200), whole[i:i + 1])
    assert torch.equal(rg.run(x[4:9], panels, 200), whole[4:9])


def test_pack_unpack_round_trip_and_padding():
    w = torch.randn(70, 12).bfloat16()
    panels = rg.pack(w)
    assert panels.shape == (8, 6, 32)                         # 70 columns padded to 2 tiles of 4 panels
    assert torch.equal(rg.unpack(panels, 70), w)
    packed = rg.RowsWeightBF16(w)
    assert packed.nbytes == 8 * 6 * 32 * 2 + (70 * 12 * 2 if packed.onednn is not None else 0)   # + oneDNN's copy


def test_strided_rows_and_autograd_fallback():
    w = torch.randn(64, 32).bfloat16()
    packed = rg.RowsWeightBF16(w)
    x = torch.randn(5, 64).bfloat16()[:, :32]                 # rows 64 apart
    assert torch.equal(rg.rows_linear(x, packed), rg.rows_linear(x.contiguous(), packed))
    xf = torch.randn(3, 32, requires_grad=True)
    y = rg.rows_linear(xf, packed)                            # fp32 with grad: F.linear on the unpacked copy
    y.sum().backward()
    assert torch.allclose(xf.grad, w.float().sum(0).expand(3, 32))
