"""The C RMSNorm (shared/ops/rms_norm.c) against the torch path it replaces."""
from __future__ import annotations

import pytest
import torch

from shared.ops import rms_norm

pytestmark = pytest.mark.skipif(not rms_norm.available(), reason="the C RMSNorm does not build here")


@pytest.mark.parametrize("t,d", [(1, 576), (9, 576), (40, 1000), (3, 64)])
def test_fp32_matches_torch(t, d):
    g = torch.Generator().manual_seed(t)
    x, w = torch.randn(t, d, generator=g) * 3, torch.randn(d, generator=g)
    torch.testing.assert_close(rms_norm.rms_norm(x, w, 1e-5), rms_norm.reference(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_bf16_rounds_as_torch_does():
    """The same two roundings as torch: at most one bf16 step apart, where the fp32 statistics differ in the
    last bit, and that rarely."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
    got, want = rms_norm.rms_norm(x, w, 1e-5), rms_norm.reference(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-30).all()
    assert (diff > 0).float().mean() < 0.01


def test_rows_are_independent_and_strided_rows_are_read():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 2 * 96, generator=g)[:, :96], torch.randn(96, generator=g)     # rows 192 apart
    whole = rms_norm.rms_norm(x, w, 1e-6)
    assert whole.shape == (7, 96)
    for i in range(7):
        assert torch.equal(rms_norm.rms_norm(x[i:i + 1], w, 1e-6), whole[i:i + 1])
    assert torch.equal(rms_norm.rms_norm(x.reshape(7, 1, 96), w, 1e-6).view(7, 96), whole)


def test_autograd_and_other_dtypes_keep_the_torch_path():
    w = torch.ones(8, requires_grad=True)
    assert not rms_norm.supports(torch.randn(2, 8), w)                   # grad wanted
    with torch.no_grad():
        assert rms_norm.supports(torch.randn(2, 8), w)
    assert not rms_norm.supports(torch.randn(2, 8).half(), torch.ones(8).half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 576), (40, 576), (17, 1000), (3, 37)])
def test_add_then_norm_in_one_pass_is_the_add_and_the_norm(dtype, t, d):
    g = torch.Generator().manual_seed(t * d)
    x, a = (torch.randn(t, d, generator=g) * 3).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    s, y = rms_norm.add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(s, x + a)                                          # torch's add in the dtype, bit for bit
    assert torch.equal(y, rms_norm.rms_norm(x + a, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_and_avx2_paths_give_the_same_bits(dtype):
    if not rms_norm.use_avx512(True):
        pytest.skip("no AVX-512 here: only the AVX2 path runs")
    g = torch.Generator().manual_seed(3)
    try:
        for t, d in ((1, 576), (33, 576), (5, 1000), (2, 37), (1, 8)):
            x, a = (torch.randn(t, d, generator=g) * 4).to(dtype), torch.randn(t, d, generator=g).to(dtype)
            w = torch.randn(d, generator=g).to(dtype)
            runs = []
            for on in (True, False):
                assert rms_norm.use_avx512(on) == on
                runs.append((rms_norm.rms_norm(x, w, 1e-6), *rms_norm.add_rms_norm(x, a, w, 1e-6)))
            for wide, narrow in zip(*runs):
                assert torch.equal(wide, narrow), (t, d)
    finally:
        rms_norm.use_avx512(True)
