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
