"""The fp32 rows kernel (shared.ops.rows_gemm) against its torch reference, F.linear; and each row's result
independent of the rows computed beside it (what makes verification rows equal decode rows)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.ops import rows_gemm
from shared.ops.packed_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not rows_gemm.available(), reason="no AVX2 + FMA CPU or no C compiler")


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (40, 37), (17, 5), (1, 8)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 9, 13, 64])
def test_rows_linear_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    got = rows_gemm.rows_linear(x, rows_gemm.RowsWeight(w))
    want = F.linear(x.double(), w.double()).float()                     # fp64 reference: both fp32 paths are off it
    assert got.shape == (m, n) and got.dtype == torch.float32
    err_ours = (got - want).abs().max().item()
    err_mkl = (F.linear(x, w) - want).abs().max().item()
    assert err_ours <= 4 * err_mkl + 1e-6 * k ** 0.5, (err_ours, err_mkl)


def test_a_row_does_not_depend_on_its_neighbours():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(100, 576, generator=g), torch.randn(23, 576, generator=g)
    packed = rows_gemm.RowsWeight(w)
    whole = rows_gemm.rows_linear(x, packed)
    for i in range(23):
        assert torch.equal(rows_gemm.rows_linear(x[i:i + 1], packed), whole[i:i + 1])
    assert torch.equal(rows_gemm.rows_linear(x[3:12], packed), whole[3:12])


def test_threads_give_the_same_result():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(3072, 576, generator=g), torch.randn(9, 576, generator=g)
    packed = rows_gemm.RowsWeight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rows_gemm.rows_linear(x, packed)
        torch.set_num_threads(2)
        two = rows_gemm.rows_linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bias_leading_dims_empty_rows_and_autograd():
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(33, 20)
    packed = PackedLinear(lin.weight, lin.bias)
    x = torch.randn(2, 3, 33, generator=g)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(0, 33)).shape == (0, 20)
    assert packed.packed_nbytes == 32 * 33 * 4                          # 20 columns padded to two panels of 16
    assert torch.equal(packed.weight, lin.weight.detach())              # unpacked from the panels
    xg = torch.randn(4, 33, requires_grad=True)
    packed(xg).sum().backward()                                         # falls back to F.linear on the weight
    torch.testing.assert_close(xg.grad, lin.weight.detach().sum(0).expand(4, 33))
    kept = PackedLinear(lin.weight, lin.bias, keep_weight=True)         # a kept weight trains through itself
    kept(xg).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (20, 33)
    torch.testing.assert_close(lin.weight.grad, xg.detach().sum(0).expand(20, 33))   # d sum(x W^T) / dW


def test_pack_linears_packs_fp32_models():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    want = net(x).detach()
    assert pack_linears(net) == 2
    assert all(type(m) is PackedLinear for m in (net[0], net[2]))
    with torch.no_grad():
        torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-6)


def test_freeing_a_packed_ffn_counts_and_drops_its_panels():
    """attach_expert_shards frees the target's local FFN weights: a PackedLinear's packed copy is not a parameter
    or buffer, so it is released explicitly (before, its bytes were neither counted nor freed)."""
    from shared.shards.remote_ffn import _free

    mlp = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False))
    assert pack_linears(mlp) == 2
    assert _free(mlp, keep=()) == 2 * 16 * 32 * 4
    assert all(m.packed is None and m.packed_nbytes == 0 for m in mlp)
    assert _free(mlp, keep=()) == 0
    with pytest.raises(RuntimeError, match="released"):
        mlp(torch.randn(2, 16))
