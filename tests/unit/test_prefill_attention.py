"""Long prefill chunks' attention (shared.ops.prefill_attention) against the torch reference: the kernel's builds
that run here (AMX tiles, AVX512-BF16 vectors), the fp32 kernel (AVX2) and torch's SDPA split, on odd lengths,
prefix-cache hits in the middle of a block, sliding windows, GQA ratios and head dims; and a step mixing decodes
with a long chunk through shared.ops.cpu_attention."""
from __future__ import annotations

import pytest
import torch

from shared.ops import cpu_attention, prefill_attention
from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref

KERNELS = prefill_attention.kernels()


@pytest.fixture(params=["amx", "avx512-bf16"])
def kernel(request, monkeypatch):
    """Each build of the kernel in turn, as attention()'s (skipped where the CPU lacks its instructions)."""
    if request.param not in KERNELS:
        pytest.skip(f"the {request.param} build does not run on this CPU")
    monkeypatch.setattr(prefill_attention, "_lib", lambda: KERNELS[request.param])
    return request.param


def _cache(length: int, kvh: int, dh: int, dtype: torch.dtype, bs: int = 16, spread: float = 1.0, seed: int = 0):
    """Random K/V for `length` positions in shuffled blocks (with spare blocks around them) -> caches, table."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-length // bs) + 5
    k = (torch.randn(nb, bs, kvh, dh, generator=g) * spread).to(dtype)
    v = torch.randn(nb, bs, kvh, dh, generator=g).to(dtype)
    return k, v, torch.randperm(nb, generator=g)[: -(-length // bs)]


def _reference(q, k, v, table, length, scale, window=None) -> torch.Tensor:
    n = q.shape[0]
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64), table[None], torch.tensor([length]),
                             torch.tensor([0, n]), 0, [n], [length], n)
    return paged_attention_ref(q.float(), k.float(), v.float(), meta, scale, window)


CASES = [  # new tokens, tokens in the cache after the step, heads, kv heads, head dim
    (1, 1, 9, 3, 64), (17, 17, 9, 3, 64), (100, 100, 9, 3, 64), (70, 301, 9, 3, 64), (33, 1000, 9, 3, 64),
    (300, 1013, 4, 1, 64), (65, 200, 8, 8, 128), (40, 90, 6, 2, 256), (259, 259, 2, 2, 192),
    (200, 9000, 9, 3, 64),                       # past the default model's window: no length limit of its own
]


@pytest.mark.parametrize("n,length,h,kvh,dh", CASES)
def test_kernel_matches_reference(n, length, h, kvh, dh, kernel):
    k, v, table = _cache(length, kvh, dh, torch.bfloat16)
    q = torch.randn(n, h, dh, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = prefill_attention.attention(q, k, v, table, length, dh ** -0.5)
    want = _reference(q, k, v, table, length, dh ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,length,window", [(300, 1000, 100), (40, 77, 33), (64, 64, 1), (50, 500, 499),
                                             (100, 9000, 4096)])
def test_kernel_sliding_window(n, length, window, kernel):
    k, v, table = _cache(length, 3, 64, torch.bfloat16)
    q = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = prefill_attention.attention(q, k, v, table, length, 0.125, window)
    torch.testing.assert_close(got.float(), _reference(q, k, v, table, length, 0.125, window), rtol=2e-2, atol=2e-2)


def test_kernel_peaked_scores(kernel):
    """Scores far apart (keys scaled up): columns' maxima grow block after block, and most weights round to 0."""
    k, v, table = _cache(700, 3, 64, torch.bfloat16, spread=8.0)
    q = torch.randn(600, 9, 64, generator=torch.Generator().manual_seed(3)).bfloat16() * 4
    got = prefill_attention.attention(q, k, v, table, 700, 0.125)
    torch.testing.assert_close(got.float(), _reference(q, k, v, table, 700, 0.125), rtol=2e-2, atol=2e-2)


def test_kernel_reads_strided_rows(kernel):
    """q as the attention layer hands it over: a view of the fused qkv rows."""
    k, v, table = _cache(200, 3, 64, torch.bfloat16)
    qkv = torch.randn(150, (9 + 6) * 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    q = qkv[:, :9 * 64].view(150, 9, 64)
    got = prefill_attention.attention(q, k, v, table, 200, 0.125)
    torch.testing.assert_close(got.float(), _reference(q, k, v, table, 200, 0.125), rtol=2e-2, atol=2e-2)


@pytest.fixture
def f32_kernel(monkeypatch):
    """The fp32 kernel, with torch's SDPA made to fail so that a case cannot pass through it instead."""
    if prefill_attention._f32_lib() is None:
        pytest.skip("the fp32 kernel needs AVX2 and FMA")

    def no_sdpa(*args, **kwargs):
        raise AssertionError("torch's SDPA ran instead of the kernel")
    monkeypatch.setattr(prefill_attention, "_sdpa", no_sdpa)


@pytest.mark.parametrize("n,length,h,kvh,dh", CASES + [(30, 45, 4, 2, 36)])
def test_f32_kernel_matches_reference(n, length, h, kvh, dh, f32_kernel):
    k, v, table = _cache(length, kvh, dh, torch.float32)
    q = torch.randn(n, h, dh, generator=torch.Generator().manual_seed(1))
    got = prefill_attention.attention(q, k, v, table, length, dh ** -0.5)
    want = _reference(q, k, v, table, length, dh ** -0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,length,window", [(300, 1000, 100), (40, 77, 33), (64, 64, 1), (50, 500, 499),
                                             (100, 9000, 4096)])
def test_f32_kernel_sliding_window(n, length, window, f32_kernel):
    k, v, table = _cache(length, 3, 64, torch.float32)
    q = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(2))
    got = prefill_attention.attention(q, k, v, table, length, 0.125, window)
    torch.testing.assert_close(got, _reference(q, k, v, table, length, 0.125, window), rtol=1e-5, atol=1e-5)


def test_f32_kernel_peaked_scores_and_strided_rows(f32_kernel):
    """Scores far apart (columns' maxima grow block after block, most weights underflow), q a view of qkv rows."""
    k, v, table = _cache(700, 3, 64, torch.float32, spread=8.0)
    qkv = torch.randn(600, (9 + 6) * 64, generator=torch.Generator().manual_seed(3)) * 4
    q = qkv[:, :9 * 64].view(600, 9, 64)
    got = prefill_attention.attention(q, k, v, table, 700, 0.125)
    torch.testing.assert_close(got, _reference(q, k, v, table, 700, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,length,h,kvh,dh", CASES[:6])
def test_sdpa_split_matches_reference(n, length, h, kvh, dh, dtype, tol):
    k, v, table = _cache(length, kvh, dh, dtype)
    q = torch.randn(n, h, dh, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = prefill_attention._sdpa(q, k, v, table, length, dh ** -0.5)
    torch.testing.assert_close(got.float(), _reference(q, k, v, table, length, dh ** -0.5), rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk", [200, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_with_decodes_and_a_prompt_chunk(dtype, chunk):
    """Two decode rows and a prompt chunk resuming mid-block in one step, as the model calls it: 200 rows go to
    prefill_attention everywhere; 16 rows at 637 positions to the prefill kernel where it runs (tiled_chunks)."""
    if not cpu_attention.supports(torch.zeros(1, 9, 64, dtype=dtype), torch.zeros(1, 16, 3, 64, dtype=dtype)):
        pytest.skip("the CPU attention kernel does not run here")
    k, v, _ = _cache(16 * 60, 3, 64, dtype)
    tables = torch.zeros(3, 45, dtype=torch.int64)                       # padded with block 0, as the runner does
    tables[0, :8], tables[1, :8], tables[2] = torch.arange(0, 8), torch.arange(8, 16), torch.arange(20, 65)
    lens, qlens = [100, 7, 637], [1, 1, chunk]
    t = sum(qlens)
    q = torch.randn(t, 9, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    meta = AttentionMetadata(torch.zeros(t, dtype=torch.int64), tables, torch.tensor(lens), torch.tensor([0, 1, 2, t]),
                             2, qlens, lens, chunk, prompt_chunks=[False, False, True])
    assert cpu_attention.tiled_chunks(meta) == ({2} if chunk <= cpu_attention.MAX_ROWS else set())
    got = cpu_attention.paged_attention(q, k, v, meta, 0.125)
    want = paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
