"""The compiled Triton kernels on a CUDA GPU against their torch references (skipped without one).

The CPU suite runs the same kernels under TRITON_INTERPRET=1 at small shapes; this file checks what only a GPU
shows: the compiled code (bf16/fp16 tensor-core tl.dot, fp32 with input_precision="ieee"), shapes the size of
real layers and contexts, and the engine on CUDA against the engine on CPU. Run it where a GPU is present:

    TRITON_INTERPRET= python -m pytest tests/gpu -q
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("unset TRITON_INTERPRET to run the compiled kernels", allow_module_level=True)

from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from shared.ops.paged_attention_triton import paged_attention_triton  # noqa: E402
from shared.quant.nvfp4 import NVFP4Weight, quantise_weight  # noqa: E402
from shared.quant.nvfp4_linear import nvfp4_linear  # noqa: E402
from shared.quant.nvfp4_triton import nvfp4_matmul  # noqa: E402
from shared.tree import ancestor_mask  # noqa: E402
from shared.testing.paged_batches import MIXED, SHARE, make_batch, random_parents  # noqa: E402

CUDA = torch.device("cuda")
# bf16/fp16 outputs: the kernel rounds p to the cache dtype before PV (FlashAttention does too); the reference
# does not, so a few output ulps apart
ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def on_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    meta = AttentionMetadata(meta.slot_mapping.to(CUDA), meta.block_tables.to(CUDA), meta.seq_lens.to(CUDA),
                             meta.query_start_loc.to(CUDA), meta.num_decodes, meta.query_lens, meta.seq_lens_host,
                             meta.max_query_len, {b: m.to(CUDA) for b, m in meta.tree_masks.items()})
    return q.to(CUDA), k.to(CUDA), v.to(CUDA), meta


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, block_n: int | None,
          atol: float, window: int | None = None, softcap: float | None = None) -> None:
    scale = q.shape[-1] ** -0.5
    out = paged_attention_triton(q, k, v, meta, scale, block_n=block_n, window=window, softcap=softcap)
    # the reference in fp32 from the same (rounded) inputs: the kernel's accumulation is fp32 too
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, scale, window, softcap)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_cuda
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("h,kvh,dh", [(2, 2, 64), (6, 2, 64), (9, 3, 64), (32, 8, 128)], ids=str)
@pytest.mark.parametrize("block_n", [16, 64, None], ids=str)
def test_mixed_batches(h: int, kvh: int, dh: int, dtype: torch.dtype, block_n: int | None) -> None:
    """Decodes, a prompt, a chunk after cached context and verifications, with shared prefix blocks."""
    check(*on_cuda(*make_batch(MIXED, SHARE, h, kvh, dh, 16, dtype)), block_n, ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_contexts_and_many_sequences(dtype: torch.dtype) -> None:
    """48 sequences, contexts up to 3,000 positions in 32-position blocks: many KV tiles per program."""
    g = torch.Generator().manual_seed(1)
    lens = [(int(n), 1) for n in torch.randint(1, 3000, (40,), generator=g)] + [(2900, 300), (1500, 9),
                                                                              (700, 700), (64, 5)]
    check(*on_cuda(*make_batch(lens, [], 9, 3, 64, 32, dtype)), None, ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_draft_trees(dtype: torch.dtype) -> None:
    """Trees of 3, 9 and 64 nodes (the sign bit of the int64 masks) beside decodes and a long prefill."""
    lens = [(17, 1), (40, 1), (30, 4), (90, 70), (25, 10), (100, 65)]
    q, k, v, meta = make_batch(lens, [(5, 0, 1)], 6, 2, 64, 16, dtype)
    meta.tree_masks = {2: ancestor_mask([-1, -1, 0]), 4: ancestor_mask(random_parents(9, 2)),
                       5: ancestor_mask(random_parents(64, 3))}
    check(*on_cuda(q, k, v, meta), 32, ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 16, 100, 4096], ids=str)
def test_sliding_windows(dtype: torch.dtype, window: int) -> None:
    """Windows from 1 position to past every context, over long contexts, a long prefill and draft trees."""
    g = torch.Generator().manual_seed(2)
    lens = [(int(n), 1) for n in torch.randint(1, 2000, (20,), generator=g)] + [(1900, 300), (40, 10), (300, 65)]
    q, k, v, meta = make_batch(lens, [], 9, 3, 64, 16, dtype)
    meta.tree_masks = {21: ancestor_mask(random_parents(9, 5)), 22: ancestor_mask(random_parents(64, 6))}
    check(*on_cuda(q, k, v, meta), 64, ATOL[dtype], window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 100], ids=str)
def test_soft_capped_scores(dtype: torch.dtype, window: int | None) -> None:
    """Gemma 2's soft cap (scores up to about 10 times the cap), alone and with a window, with trees."""
    g = torch.Generator().manual_seed(3)
    lens = [(int(n), 1) for n in torch.randint(1, 1500, (12,), generator=g)] + [(900, 200), (40, 10)]
    q, k, v, meta = make_batch(lens, [], 8, 2, 128, 16, dtype)
    meta.tree_masks = {13: ancestor_mask(random_parents(9, 7))}
    check(*on_cuda(q * 6, k, v, meta), 64, ATOL[dtype], window, 5.0)


ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (5, 48, 96), (33, 70, 160), (1, 3072, 576), (16, 576, 1536),
                                   (300, 1000, 2048)], ids=str)
@pytest.mark.parametrize("tiles", [(32, 64, 64), (16, 128, 128), (64, 32, 32)], ids=str)
def test_nvfp4_gemm(m: int, n: int, k: int, dtype: torch.dtype, tiles: tuple[int, int, int]) -> None:
    """W4A16 against the dequantised fp32 product: both round one fp32 result to dtype, at most two ulps apart
    (plus the fp32 accumulation order over K)."""
    g = torch.Generator().manual_seed(m * n + k)
    w = quantise_weight(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    ref = x.float() @ w.dequantise(torch.float32).T                        # [M, N] on CPU, fp32
    wc = NVFP4Weight(w.packed.to(CUDA), w.scale.to(CUDA), w.global_scale.to(CUDA))
    y = nvfp4_matmul(x.to(CUDA), wc, *tiles)
    assert y.shape == (m, n) and y.dtype == dtype and y.is_cuda
    atol = 1e-5 * k ** 0.5 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2 * ULP[dtype] + 1e-6, atol=atol)


def every_scale_weight(k: int, global_scale: float, g: torch.Generator) -> tuple[NVFP4Weight, NVFP4Weight]:
    """A [127, k] weight whose row r uses e4m3 scale bit pattern r (zero and subnormals included) with random
    codes, on the CPU and on CUDA."""
    one_scale = torch.arange(0, 0x7F, dtype=torch.uint8)[:, None].expand(-1, k // 16).contiguous()  # [127, B]
    packed = torch.randint(0, 256, (127, k // 2), dtype=torch.uint8, generator=g)
    w = NVFP4Weight(packed, one_scale.view(torch.float8_e4m3fn), torch.tensor([global_scale]))
    return w, NVFP4Weight(w.packed.to(CUDA), w.scale.to(CUDA), w.global_scale.to(CUDA))


def test_nvfp4_bit_exact_on_exact_operands() -> None:
    """Every e4m3 scale bit pattern and every E2M1 code with integer activations: sums exact in fp32, so the GPU
    and the reference agree bit for bit whatever the accumulation order (fp32 in IEEE mode, bf16 on tensor
    cores: products of bf16 values are exact in fp32)."""
    g = torch.Generator().manual_seed(0)
    w, wc = every_scale_weight(128, 0.25, g)
    x = torch.randint(-3, 4, (7, 128), generator=g).float()
    assert torch.equal(nvfp4_matmul(x.to(CUDA), wc, block_k=64).cpu(), x @ w.dequantise().T)
    assert torch.equal(nvfp4_matmul(x.bfloat16().to(CUDA), wc).cpu(), nvfp4_linear(x.bfloat16(), w))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_matches_transformers(tmp_path, dtype: str) -> None:
    """The whole engine on CUDA (paged KV cache, the Triton attention kernel, chunked batches of several
    sequences) against transformers on the same GPU: logits of a 150-token prompt, and greedy tokens in fp32."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from shared.testing.tiny_llama import save_tiny

    ref = save_tiny(tmp_path, None).to(CUDA, getattr(torch, dtype))
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16,
                                 device="cuda", dtype=dtype))
    ids = torch.randint(1, 90, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids], device=CUDA)).logits[0].float()
    torch.testing.assert_close(eng.score(ids).float(), expect, rtol=0,
                               atol=1e-3 if dtype == "float32" else 0.03 * expect.abs().max().item())
    if dtype != "float32":
        return
    prompts = [ids[:n] for n in (20, 7, 33)]
    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, got):
        with torch.inference_mode():
            g = ref.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, temperature=None, top_p=None, top_k=None)
        assert out[0] == g[0, len(prompt):].tolist()


@pytest.mark.parametrize("m", [1, 16, 17, 64, 128, 300], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_gemm_default_tiles(m: int, dtype: torch.dtype) -> None:
    """The tiles nvfp4_matmul picks by row count (tiles_for) against the dequantised product."""
    g = torch.Generator().manual_seed(m)
    w = quantise_weight(torch.randn(1000, 2048, generator=g))
    x = torch.randn(m, 2048, generator=g).to(dtype)
    ref = x.float() @ w.dequantise(torch.float32).T
    wc = NVFP4Weight(w.packed.to(CUDA), w.scale.to(CUDA), w.global_scale.to(CUDA))
    y = nvfp4_matmul(x.to(CUDA), wc)
    atol = 1e-5 * 2048 ** 0.5 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2 * ULP[dtype] + 1e-6, atol=atol)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16], ids=str)
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (1000, 2064), (4096, 2048)], ids=str)
@pytest.mark.parametrize("split_k", [None, 1, 5], ids=str)
def test_nvfp4_gemv(m: int, n: int, k: int, split_k: int | None) -> None:
    """The few-row kernel compiled, against the dequantised product: bf16 rows, K split or not (K not a multiple of
    the tile in 2064)."""
    from shared.quant.nvfp4_triton import nvfp4_gemv
    g = torch.Generator().manual_seed(m + n + k)
    w = quantise_weight(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).bfloat16()
    ref = x.float() @ w.dequantise(torch.float32).T
    wc = NVFP4Weight(w.packed.to(CUDA), w.scale.to(CUDA), w.global_scale.to(CUDA))
    y = nvfp4_gemv(x.to(CUDA), wc, split_k=split_k)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.is_cuda
    atol = 1e-5 * k ** 0.5 * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2 * ULP[torch.bfloat16] + 1e-6, atol=atol)


def test_nvfp4_gemv_exact_operands() -> None:
    """Every e4m3 scale and E2M1 code with integer activations: the compiled GEMV equals the product bit for bit."""
    from shared.quant.nvfp4_triton import nvfp4_gemv
    g = torch.Generator().manual_seed(3)
    k = 4096
    w, wc = every_scale_weight(k, 0.5, g)
    for m in (1, 5, 16):
        x = torch.randint(-3, 4, (m, k), generator=g).float()
        for split_k in (1, 4):
            assert torch.equal(nvfp4_gemv(x.to(CUDA), wc, split_k=split_k).cpu(), x @ w.dequantise().T)
