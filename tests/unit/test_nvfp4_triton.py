"""The Triton NVFP4 GEMM against its torch reference, under TRITON_INTERPRET=1 on CPU (small shapes)."""
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from shared.quant.nvfp4 import NVFP4ShapeError, NVFP4Weight, quantise_weight
from shared.quant.nvfp4_linear import nvfp4_linear
from shared.testing.triton_cpu import interpreted

NVFP4DeviceError = nvfp4_matmul = nvfp4_gemv = None       # the interpreted module's, set by `kernels`


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The kernel module under TRITON_INTERPRET=1 for this module's tests only."""
    global NVFP4DeviceError, nvfp4_matmul, nvfp4_gemv
    with interpreted("shared.quant.nvfp4_triton") as (mod,):
        assert isinstance(mod._nvfp4_gemm_kernel, InterpretedFunction)
        assert isinstance(mod._nvfp4_gemv_kernel, InterpretedFunction)
        NVFP4DeviceError, nvfp4_matmul, nvfp4_gemv = mod.NVFP4DeviceError, mod.nvfp4_matmul, mod.nvfp4_gemv
        yield


ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (5, 48, 96), (33, 70, 160)])  # tails in M, N and K
def test_matches_torch_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    w = quantise_weight(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    y = nvfp4_matmul(x, w, block_m=16, block_n=32, block_k=32)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = x.float() @ w.dequantise(torch.float32).T                        # [M, N] in fp32
    # the kernel and the reference both round one fp32 result to dtype: at most one output ulp apart
    torch.testing.assert_close(y.float(), ref, rtol=2 * ULP[dtype] + 1e-6, atol=1e-5)
    torch.testing.assert_close(y.float(), nvfp4_linear(x, w).float(), rtol=2 * ULP[dtype] + 1e-6, atol=1e-5)


def test_bit_exact_on_exact_operands() -> None:
    """Integer activations, a power-of-two global scale, and weights whose sums stay exact in fp32: kernel and
    reference must then agree bit for bit, whatever their order of accumulation.
    Row r of the first weight uses fp8 scale bit pattern r for all its blocks (every finite non-negative e4m3
    value, zero and subnormals included); the second varies power-of-two scales from block to block."""
    g = torch.Generator().manual_seed(0)
    k = 128
    one_scale = torch.arange(0, 0x7F, dtype=torch.uint8)[:, None].expand(-1, k // 16).contiguous()  # [127, B]
    per_block = (torch.randint(-3, 4, (32, k // 16), generator=g).float().exp2()).to(torch.float8_e4m3fn)
    for scale, gs in ((one_scale.view(torch.float8_e4m3fn), 0.25), (per_block, 1.0)):
        n = scale.shape[0]
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)  # every code
        w = NVFP4Weight(packed, scale, torch.tensor([gs]))
        x = torch.randint(-3, 4, (7, k), generator=g).float()
        y = nvfp4_matmul(x, w, block_k=64)
        assert torch.equal(y, x @ w.dequantise().T)
        assert torch.equal(nvfp4_matmul(x.bfloat16(), w), nvfp4_linear(x.bfloat16(), w))


def test_leading_dims_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    w = quantise_weight(torch.randn(16, 32))
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(nvfp4_matmul(x, w), nvfp4_linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(NVFP4ShapeError):
        nvfp4_matmul(torch.randn(2, 48), w)
    with pytest.raises(NVFP4ShapeError):
        nvfp4_matmul(x, w, block_k=48)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(NVFP4DeviceError):
        nvfp4_matmul(x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (2, 48, 96), (5, 70, 160), (16, 33, 272), (1, 200, 1040)])
@pytest.mark.parametrize("split_k", [None, 1, 3], ids=str)
def test_gemv_matches_torch_reference(m: int, n: int, k: int, dtype: torch.dtype, split_k: int | None) -> None:
    """The few-row kernel: tails in N and K (K not a multiple of its tile), 1 to 16 rows, K split over programs
    (by default the interpreter counts 4 multiprocessors, so small products split too)."""
    g = torch.Generator().manual_seed(m * n + k)
    w = quantise_weight(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    y = nvfp4_gemv(x, w, split_k=split_k)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = x.float() @ w.dequantise(torch.float32).T                        # [M, N] in fp32
    torch.testing.assert_close(y.float(), ref, rtol=2 * ULP[dtype] + 1e-6, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(nvfp4_matmul(x, w), y, rtol=0, atol=1e-5 * k ** 0.5)     # the tiled kernel


def test_gemv_zero_and_subnormal_blocks() -> None:
    """Every e4m3 scale bit pattern (zero and subnormals included) and every code, with integer activations:
    exact sums, so the GEMV kernel equals the dequantised product bit for bit, split or not."""
    g = torch.Generator().manual_seed(1)
    k = 160
    one_scale = torch.arange(0, 0x7F, dtype=torch.uint8)[:, None].expand(-1, k // 16).contiguous()  # [127, B]
    packed = torch.randint(0, 256, (127, k // 2), dtype=torch.uint8, generator=g)
    packed[::5] = 0                                                        # whole rows of zero codes
    w = NVFP4Weight(packed, one_scale.view(torch.float8_e4m3fn), torch.tensor([0.5]))
    for m in (1, 3, 16):
        x = torch.randint(-3, 4, (m, k), generator=g).float()
        for split_k in (1, 2, 5):
            assert torch.equal(nvfp4_gemv(x, w, block_k=32, split_k=split_k), x @ w.dequantise().T)


def test_gemv_errors() -> None:
    w = quantise_weight(torch.randn(16, 64))
    with pytest.raises(NVFP4ShapeError):
        nvfp4_gemv(torch.randn(17, 64), w)
    with pytest.raises(NVFP4ShapeError):
        nvfp4_gemv(torch.randn(1, 64), w, block_k=48)
    with pytest.raises(NVFP4ShapeError):
        nvfp4_gemv(torch.randn(1, 32), w)
