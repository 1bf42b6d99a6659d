"""Block-quantised weights kept packed (shared/ops/qgemm.c, qgemm_amx.c, qgemm_avx2.c) against their torch
reference: the dequantised weight (BlockQuant.dequantise) times x in fp64, on every expansion path, odd shapes, 1-64
rows, zero and subnormal blocks; the packed layout round trip; rows independent of the rows beside them."""
from __future__ import annotations

import pytest
import torch

from shared.ops import qgemm, qgemm_avx2, rows_gemm_bf16
from shared.ops.block_quant import BlockQuant
from shared.ops.qgemm import QWeight

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="needs AVX512-BF16 or AVX2, and a C compiler")
needs_bf16 = pytest.mark.skipif(qgemm._kernels() is None, reason="needs the AVX512-BF16 kernels")

# name -> (example kind, block, has mins, the kernel's expansion path)
FORMATS = {"q4-affine": ("u4", 32, True, 5), "q4-affine-16": ("u4", 16, False, 5), "e2m1": ("e2m1", 16, False, 4),
           "nvfp4": ("nvfp4", 16, False, 4), "u6": ("u6", 16, True, 7), "u6-32": ("u6", 32, False, 7),
           "int8": ("i8", 32, False, 8), "int8-16": ("i8", 16, True, 8)}


def kernels() -> list[tuple[str, tuple | None]]:
    """Every kernel this machine builds, with its bf16 entry points: AVX512-BF16's, and AMX's where the CPU has
    it; else the AVX2 kernel (fp32 rows only: None)."""
    if qgemm._kernels() is None:
        return [("avx2", None)] if qgemm.available() else []
    out = [("avx512", (qgemm._lib().upesi_qgemm, qgemm._lib().upesi_qgemm_f32))]
    if qgemm._amx_lib() is not None:
        out.append(("amx", (qgemm._amx_lib().upesi_qgemm_amx, qgemm._amx_lib().upesi_qgemm_amx_f32)))
    return out


def run_fp32(x: torch.Tensor, w: QWeight, fns) -> torch.Tensor:
    """x [M, K] fp32 through one kernel, as qgemm.run does: the AVX2 kernel directly; the AVX-512 ones as three bf16
    parts, summed in fp32."""
    if fns is None:
        return qgemm_avx2.call(x, w)
    m = x.shape[0]
    y = qgemm._call(qgemm.split_bf16(x).view(3 * m, -1), w, None, torch.float32, fns).view(3, m, -1)
    return (y[0] + y[1]) + y[2]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(40, 96), (64, 160), (7, 32)])
def test_kernels_equal_the_dequantised_weight(fmt: str, n: int, k: int) -> None:
    kind, block, has_min, path = FORMATS[fmt]
    g = torch.Generator().manual_seed(n + k)
    bq = qgemm.example(kind, n, k, block, g, has_min)
    w = QWeight(bq)
    assert w.kind == path
    assert w.exact_bf16 == (fmt == "nvfp4")                        # fp8 scales: bf16 weights over the whole of K
    ref_w = bq.dequantise()
    assert torch.equal(w.dequantise(), ref_w)                       # the layout round-trips exactly
    for name, fns in kernels():
        for m in (1, 2, 3, 5, 16, 17, 33, 64):
            x = torch.randn(m, k, generator=g)
            want = x.double() @ ref_w.double().t()
            fp32 = (x @ ref_w.t()).double()                        # an fp32 matmul's own error, for scale
            tol = 4 * (fp32 - want).abs().max().item() + 1e-6 * want.abs().max().item()
            got = run_fp32(x, w, fns)
            assert (got.double() - want).abs().max().item() <= tol, (name, m)
            if fns is None:
                continue
            xb = x.bfloat16()
            got_b = qgemm._call(xb, w, None, torch.bfloat16, fns)
            exact_b = qgemm._call(xb, w, None, torch.float32, fns)
            assert torch.equal(got_b, exact_b.bfloat16()), (name, m)  # bf16 output: the fp32 result, rounded once
            want_b = xb.double() @ ref_w.double().t()
            assert (exact_b.double() - want_b).abs().max().item() <= 4 * tol + 1e-6, (name, m)


@pytest.mark.parametrize("name,fns", kernels())
@pytest.mark.parametrize("k", [128, 1056, 592])
def test_a_row_is_computed_alike_whatever_rows_share_the_call(name: str, fns, k: int) -> None:
    """Every kernel path (AMX's takes blocks of 16 two to a step at 1-2 rows, many blocks a tile) against the same
    rows in a wider call; K = 1056 and 592 give several groups of blocks and odd block counts."""
    g = torch.Generator().manual_seed(7)
    for fmt in ("q4-affine", "e2m1", "nvfp4", "int8", "u6"):
        kind, block, has_min, _ = FORMATS[fmt]
        if k % block:
            continue
        w = QWeight(qgemm.example(kind, 72, k, block, g, has_min))
        x = torch.randn(40, k, generator=g)
        if fns is not None:
            x = x.bfloat16()
        call = qgemm_avx2.call if fns is None else (lambda x, w: qgemm._call(x, w, None, torch.float32, fns))
        full = call(x, w)
        for lo, hi in ((0, 1), (5, 6), (39, 40), (7, 9), (3, 20), (16, 33), (2, 18), (30, 34), (10, 15), (20, 26),
                       (33, 40), (1, 9)):
            assert torch.equal(call(x[lo:hi], w), full[lo:hi]), (fmt, lo, hi)


def test_zero_and_subnormal_blocks() -> None:
    g = torch.Generator().manual_seed(3)
    bq = qgemm.example("u4", 32, 128, 32, g, has_min=True)
    bq.scales[0] = 0.0                                              # a zero block scale and min
    bq.mins[0] = 0.0
    bq.scales[1, 1] = 2.0 ** -24                                    # fp16 subnormals
    bq.mins[1, 2] = -(2.0 ** -20)
    bq.codes[2, :32] = 0
    w = QWeight(bq)
    x = torch.randn(3, 128, generator=g)
    want = x.double() @ bq.dequantise().double().t()
    got = qgemm.run(x, w).double()
    assert torch.equal(got[:, 0], torch.zeros(3, dtype=torch.float64))
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    nv = qgemm.example("e2m1", 32, 64, 16, g, has_min=False)
    nv.scales[3] = 1e-40                                            # an fp32 subnormal step
    got = qgemm.run(x[:, :64], QWeight(nv)).double()
    want = x[:, :64].double() @ nv.dequantise().double().t()
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


@needs_bf16
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "nvfp4"])
def test_wide_bf16_calls_multiply_the_weight_dequantised_to_bf16(fmt: str) -> None:
    """A prefill's chunk (WIDE_ROWS rows or more, bf16): the weight dequantised in C to bf16 (each value the
    reference's rounded once, up to a fused multiply-add's last bit before it), then torch's bf16 matmul; fused
    (on AMX up to FUSED_MAX_ROWS rows), bit for bit the rows kernel of the machine's kind over that bf16 weight
    (AMX's, or AVX512-BF16's: a partial row tile and a partial pair of units)."""
    kind, block, has_min, _ = FORMATS[fmt]
    g = torch.Generator().manual_seed(7)
    n, k = 70, 96                                                  # a partial unit of columns
    bq = qgemm.example(kind, n, k, block, g, has_min)
    w = QWeight(bq)
    ref = bq.dequantise().t()                                      # [K, N] fp32
    got = qgemm.dequantise_bf16(w)
    assert got.shape == (k, n) and got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs() <= ref.abs() * 2 ** -8).all()
    assert (got == ref.bfloat16()).float().mean() > 0.999
    bias = torch.randn(n, generator=g)
    assert (qgemm._wide_fn() is not None) == (qgemm.kernel_name() in ("amx", "avx512-bf16"))   # self-checks passed
    for m in (qgemm.WIDE_ROWS, qgemm.WIDE_ROWS + 5, qgemm.FUSED_MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g).bfloat16()
        if qgemm._wide_fn() is not None and m <= qgemm.fused_max_rows():   # fused, as the rows kernel multiplies
            kernel = (rows_gemm_bf16._amx_lib().upesi_rows_gemm_amx if qgemm.kernel_name() == "amx"
                      else rows_gemm_bf16._lib().upesi_rows_gemm_bf16)
            want = rows_gemm_bf16._call(kernel, x, rows_gemm_bf16.pack(got.t().contiguous()), n, bias.bfloat16())
        else:
            want = x @ got + bias.bfloat16()
        torch.testing.assert_close(qgemm.run(x, w, bias), want, rtol=0, atol=0)
    narrow = qgemm.run(x[:8], w, bias)                            # fewer rows: the codes, exactly
    torch.testing.assert_close(narrow.float(), x[:8].float() @ ref + bias.bfloat16().float(), rtol=2e-2, atol=2e-2)


@needs_bf16
def test_wide_calls_on_exact_weights_keep_them_exact() -> None:
    """Weights whose value * scale are bf16 numbers (NVFP4 with fp8 scales) go through the fused wide kernels
    unrounded, their columns' factors applied to the sums: on AMX every row equals the same row through the narrow
    kernel bit for bit (the same tile steps over K); elsewhere the exact product up to fp32 sums and one rounding."""
    g = torch.Generator().manual_seed(11)
    n, k = 70, 96
    bq = qgemm.example("nvfp4", n, k, 16, g, False)
    w = QWeight(bq)
    assert w.exact_bf16
    x = torch.randn(qgemm.WIDE_ROWS + 5, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    got = qgemm.run(x, w, bias)
    if qgemm.kernel_name() == "amx":
        narrow = torch.cat([qgemm._call(part, w, bias, torch.bfloat16) for part in (x[:100], x[100:])])
        assert torch.equal(got, narrow)
    want = x.double() @ bq.dequantise().double().t() + bias.double()
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.skipif(qgemm.kernel_name() != "avx2", reason="the AVX2 kernel serves CPUs without AVX512-BF16")
@pytest.mark.parametrize("fmt", FORMATS)
def test_wide_avx2_calls_multiply_the_weight_dequantised_to_fp32(fmt: str) -> None:
    """A prefill's chunk (WIDE_ROWS_F32 rows or more) on AVX2: the weight dequantised in C, bit for bit the
    reference's, then torch's fp32 matmul; bf16 rows take the same fp32 path."""
    kind, block, has_min, _ = FORMATS[fmt]
    g = torch.Generator().manual_seed(7)
    n, k = 70, 96                                                  # a partial unit of columns
    bq = qgemm.example(kind, n, k, block, g, has_min)
    w = QWeight(bq)
    ref = bq.dequantise()
    assert torch.equal(qgemm_avx2.dequantise_f32(w), ref)
    x = torch.randn(qgemm_avx2.WIDE_ROWS_F32, k, generator=g)
    bias = torch.randn(n, generator=g)
    torch.testing.assert_close(qgemm.run(x, w, bias), torch.nn.functional.linear(x, ref, bias), rtol=0, atol=0)
    narrow = qgemm.run(x[:5], w, bias).double()                    # fewer rows: the codes
    want = x[:5].double() @ ref.double().t() + bias.double()
    assert (narrow - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    xb = x[:3].bfloat16()
    assert torch.equal(qgemm.run(xb, w), qgemm_avx2.call(xb.float(), w).bfloat16())


def test_split_bf16_is_exact() -> None:
    x = torch.randn(1000) * torch.logspace(-20, 20, 1000)
    parts = qgemm.split_bf16(x.view(1, -1))
    assert torch.equal((parts[0].double() + parts[1].double() + parts[2].double()).float(), x.view(1, -1))


def test_fused_segments_widen_to_a_common_form() -> None:
    g = torch.Generator().manual_seed(5)
    q4 = qgemm.example("u4", 32, 64, 32, g, has_min=True)
    e2 = qgemm.example("e2m1", 16, 64, 16, g, has_min=False)
    i8 = qgemm.example("i8", 16, 64, 32, g, has_min=False)
    fused = BlockQuant.cat([q4, e2, i8])
    assert (fused.bits, fused.block) == (8, 16)
    want = torch.cat([q4.dequantise(), e2.dequantise(), i8.dequantise()])
    assert torch.equal(fused.dequantise(), want)
    x = torch.randn(4, 64, generator=g)
    got = qgemm.linear(x, QWeight(fused))
    torch.testing.assert_close(got, x @ want.t(), rtol=1e-5, atol=1e-4)


def test_fp16_rows_take_the_fp32_path() -> None:
    g = torch.Generator().manual_seed(2)
    bq = qgemm.example("u4", 40, 64, 32, g)
    x = torch.randn(3, 64, generator=g).half()
    got = qgemm.linear(x, QWeight(bq), torch.ones(40).half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, (x.float() @ bq.dequantise().t() + 1).half())


def test_linear_falls_back_to_the_dequantised_weight_for_autograd() -> None:
    g = torch.Generator().manual_seed(1)
    bq = qgemm.example("u4", 32, 64, 32, g)
    x = torch.randn(2, 64, generator=g, requires_grad=True)
    y = qgemm.linear(x, QWeight(bq))
    y.sum().backward()
    torch.testing.assert_close(x.grad, bq.dequantise().sum(0).expand(2, -1))


def test_unsupported_layouts_are_refused() -> None:
    g = torch.Generator().manual_seed(1)
    with pytest.raises(qgemm.QuantFormatError):
        QWeight(qgemm.example("u4", 8, 48, 32, g))                  # K not a multiple of the block
    bq = qgemm.example("u4", 8, 64, 32, g)
    bq.lut = torch.arange(16.0) * 0.3                               # not bf16-exact, not integers
    with pytest.raises(qgemm.QuantFormatError):
        QWeight(bq)
