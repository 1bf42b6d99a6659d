"""The int8-activation kernel (shared/ops/qgemm_i8.c) against its float64 torch reference (qgemm_i8.reference:
x quantised per block by the kernel's rule, times the BlockQuant's dequantised weight), on every code form, odd
shapes, 1-40 rows (the vector and the tile paths), zero blocks, biases and column factors; each row's bits the same
alone and among others; the wide-row path; an NVFP4 layer opted in."""
from __future__ import annotations

import pytest
import torch

from shared.ops import qgemm_i8 as qi
from shared.ops.block_quant import example
from shared.quant.nvfp4 import quantise_weight
from shared.quant.nvfp4_module import NVFP4Linear

pytestmark = pytest.mark.skipif(not qi.available(), reason="needs AVX512-VNNI, AVX512-BF16 and a C compiler")

# name -> (example kind, block, has mins)
FORMATS = {"q4-affine": ("u4", 32, True), "e2m1": ("e2m1", 16, False), "u6": ("u6", 16, True),
           "int8": ("i8", 32, False), "int8-16-min": ("i8", 16, True)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(40, 96), (16, 32), (33, 160)])
def test_kernel_equals_the_reference(fmt: str, n: int, k: int) -> None:
    kind, block, has_min = FORMATS[fmt]
    g = torch.Generator().manual_seed(n * k)
    bq = example(kind, n, k, block, g, has_min)
    colf = torch.rand(n, generator=g) + 0.5
    bias = torch.randn(n, generator=g).bfloat16()
    w = qi.QWeightI8(bq, colf)
    x = torch.randn(40, k, generator=g).bfloat16()
    x[3, :block] = 0                                            # a zero block: step 0, codes 0
    for m in (1, 2, 5, 6, 16, 17, 40):                         # both sides of the tile path's threshold
        want = qi.reference(x[:m], bq, colf, bias)
        assert rel_err(qi.linear(x[:m], w, bias, out=torch.float32), want) < 1e-6, m
        assert rel_err(qi.linear(x[:m], w, bias).float(), want) < 1e-2, m           # bf16 output
    exact = x.double() @ bq.dequantise().double().t() * colf.double() + bias.double()
    assert rel_err(qi.linear(x, w, bias, out=torch.float32), exact) > 1e-4     # x's quantisation shows


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_has_the_same_bits_alone_and_among_others(fmt: str) -> None:
    kind, block, has_min = FORMATS[fmt]
    g = torch.Generator().manual_seed(7)
    bq = example(kind, 50, 128, block, g, has_min)
    w = qi.QWeightI8(bq, torch.rand(50, generator=g) + 0.5)
    x = torch.randn(40, 128, generator=g).bfloat16()
    alone = torch.cat([qi.linear(x[r:r + 1], w, out=torch.float32) for r in range(40)])
    for m in (2, 3, 4, 5, 6, 7, 15, 16, 17, 33, 40):
        assert torch.equal(qi.linear(x[:m], w, out=torch.float32), alone[:m]), m


def test_activations_quantise_as_q8_0() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0] * 4 + [0.0] * 16]).bfloat16()
    q, step = qi.quantise_activations(x, 16)
    assert q[0, :4].tolist() == [64.0, -127.0, 32.0, 0.0]      # 0.5 * 127 = 63.5: half to even
    assert step[0].tolist() == pytest.approx([1 / 127, 0.0])


def test_wide_rows_multiply_the_weight_dequantised_once() -> None:
    g = torch.Generator().manual_seed(3)
    bq = example("e2m1", 48, 64, 16, g, False)
    colf = torch.rand(48, generator=g) + 0.5
    w = qi.QWeightI8(bq, colf)
    assert torch.equal(w.dequantise_t(), qi.weight_of(bq, colf).t().bfloat16())
    x = torch.randn(qi.WIDE_ROWS, 64, generator=g).bfloat16()
    assert torch.equal(qi.linear(x, w), x @ qi.weight_of(bq, colf).t().bfloat16())


def test_an_nvfp4_layer_opted_in_runs_the_int8_kernel() -> None:
    torch.manual_seed(0)
    layer = NVFP4Linear(64, [48, 16], bias=False)
    for i, rows in enumerate((48, 16)):
        layer.load_segment(i, quantise_weight(torch.randn(rows, 64) * 0.1))
    x = torch.randn(5, 64).bfloat16()
    exact = layer(x)
    layer.int8_activations, layer._packed = True, None
    assert isinstance(layer.packed, qi.QWeightI8)
    got = layer(x.float())
    want = qi.quantise_activations(x, 16)
    xq = (want[0].view(5, -1, 16) * want[1].unsqueeze(-1)).view(5, 64)
    assert rel_err(got, xq.double() @ layer.dequantise().double().t()) < 1e-5
    assert rel_err(got, exact.double()) > 1e-4


def test_a_table_beyond_int8_is_refused() -> None:
    from shared.ops.block_quant import BlockQuant, QuantFormatError
    lut = torch.arange(16, dtype=torch.float32) * 20                      # 0 .. 300: not int8
    bq = BlockQuant(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), None, 32, 4, lut)
    with pytest.raises(QuantFormatError, match="int8"):
        qi.QWeightI8(bq)

