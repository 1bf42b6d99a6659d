"""The bf16 rows kernels (shared/ops/rows_gemm_bf16.c, AVX512-BF16, and rows_gemm_amx.c, AMX, where the CPU has
it) against an fp32 reference and F.linear."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.ops import rows_gemm_bf16 as rg

pytestmark = pytest.mark.skipif(not rg.available(), reason="no AVX512-BF16 (or no compiler) on this machine")


def kernels() -> list:
    """Each kernel this machine runs: AVX512-BF16's, and AMX's where the CPU has it."""
    if not rg.available():
        return []
    amx = rg._amx_lib()
    return [pytest.param(rg._lib().upesi_rows_gemm_bf16, id="avx512bf16")] + (
        [pytest.param(amx.upesi_rows_gemm_amx, id="amx")] if amx is not None else [])


@pytest.mark.parametrize("fn", kernels())
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 16, 17, 33, 40, 64, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (72, 40), (576, 1536)])
def test_matches_fp32_reference_within_bf16_rounding(fn, m, n, k):
    g = torch.Generator().manual_seed(m * n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    want = x.float() @ w.float().t() + bias.float()
    got = rg._call(fn, x, rg.pack(w), n, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # one rounding of an fp32 sum: within half a bf16 ulp of the fp32 result, plus the sum's own error
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * k ** 0.5).all()
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("fn", kernels())
def test_a_row_does_not_depend_on_its_neighbours(fn):
    """Same bits alone, first, last, or in the middle of a tile of 6 (16 with AMX) and of a later one, whether
    the call's rows fill their last block or not, and read from strided rows."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(200, 576, generator=g).bfloat16(), torch.randn(37, 576, generator=g).bfloat16()
    panels = rg.pack(w)
    whole = rg._call(fn, x, panels, 200, None)
    for i in range(37):
        assert torch.equal(rg._call(fn, x[i:i + 1], panels, 200, None), whole[i:i + 1])
    for lo, hi in ((4, 9), (0, 16), (3, 35), (0, 32), (20, 37)):
        assert torch.equal(rg._call(fn, x[lo:hi], panels, 200, None), whole[lo:hi])
    wide = torch.zeros(37, 700, dtype=torch.bfloat16)
    wide[:, :576] = x
    assert torch.equal(rg._call(fn, wide[:, :576], panels, 200, None), whole)


def test_one_kernel_for_every_call_on_a_machine():
    """Where AMX runs, run() and the fused decoder take the AMX kernel for every row count; elsewhere AVX512-BF16's
    (so a verification row always equals its decode row)."""
    fn = rg._kernel()
    assert rg.kernel_address() == ctypes.cast(fn, ctypes.c_void_p).value
    amx = rg._amx_lib()
    assert rg.uses_amx() == (amx is not None)
    assert fn is (amx.upesi_rows_gemm_amx if amx is not None else rg._lib().upesi_rows_gemm_bf16)
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(21, 96, generator=g).bfloat16()
    assert torch.equal(rg.run(x, rg.pack(w), 64), rg._call(fn, x, rg.pack(w), 64, None))


def test_amx_is_used_where_the_cpu_has_it_unless_switched_off():
    if not {"amx_tile", "amx_bf16"} <= rg.cpu_flags():
        pytest.skip("no AMX on this machine")
    code = ("from shared.ops import rows_gemm_bf16 as rg; print(rg.uses_amx())")
    root = Path(__file__).resolve().parents[2]
    on = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "UPESI_AMX": "0"})
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False")


def test_pack_unpack_round_trip_and_padding():
    w = torch.randn(70, 12).bfloat16()
    panels = rg.pack(w)
    assert panels.shape == (8, 6, 32)                         # 70 columns padded to 2 tiles of 4 panels
    assert torch.equal(rg.unpack(panels, 70), w)
    assert rg.RowsWeightBF16(w).nbytes == 8 * 6 * 32 * 2


def test_strided_rows_and_autograd_fallback():
    w = torch.randn(64, 32).bfloat16()
    packed = rg.RowsWeightBF16(w)
    x = torch.randn(5, 64).bfloat16()[:, :32]                 # rows 64 apart
    assert torch.equal(rg.rows_linear(x, packed), rg.rows_linear(x.contiguous(), packed))
    xf = torch.randn(3, 32, requires_grad=True)
    y = rg.rows_linear(xf, packed)                            # fp32 with grad: F.linear on the unpacked copy
    y.sum().backward()
    assert torch.allclose(xf.grad, w.float().sum(0).expand(3, 32))
