"""The C argmax (shared/ops/argmax.c) against torch.argmax: ties, NaN, -inf rows, tails past a multiple of 8."""
from __future__ import annotations

import pytest
import torch

from shared.ops import argmax

pytestmark = pytest.mark.skipif(not argmax.available(), reason="the C argmax kernel does not build here")


@pytest.mark.parametrize("v", [1, 7, 8, 13, 49152, 49155])
def test_equals_torch_argmax(v):
    g = torch.Generator().manual_seed(v)
    ties = torch.randint(0, 4, (17, v), generator=g).float()                   # many rows with repeated maxima
    wide = torch.randn(9, v, generator=g)
    odd = torch.randn(6, v, generator=g)
    odd[0, -1] = float("nan")                                                   # a NaN in the tail
    odd[1, v // 2] = float("nan")
    odd[2] = float("-inf")
    odd[3, :] = -1.0
    odd[3, v // 3], odd[3, -1] = -0.0, 0.0                                      # -0 and +0 tie: the first wins
    odd[4, -1] = float("inf")
    for x in (ties, wide, odd):
        assert torch.equal(argmax.argmax_rows(x), x.argmax(-1))


def test_strided_rows_and_other_dtypes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 300, generator=g)
    assert torch.equal(argmax.argmax_rows(x[::2]), x[::2].argmax(-1))           # rows 600 floats apart
    b = x.bfloat16()
    assert torch.equal(argmax.argmax_rows(b), b.argmax(-1))                      # torch's path
