"""The Triton paged-attention kernel against paged_attention_ref, under TRITON_INTERPRET=1 on CPU (small shapes).

Batches are ragged like the engine's: decodes first, then multi-token sequences (a whole prompt, a chunk after
cached context, K+1 = 4 verification queries), partly filled last blocks, and block tables that share physical
blocks (a common prefix).
"""
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref
from shared.testing.triton_cpu import interpreted
from shared.testing.paged_batches import MIXED, SHARE, make_batch, random_parents

pat = PagedAttentionError = paged_attention_triton = None   # the interpreted module's, set by `kernels`


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The kernel module under TRITON_INTERPRET=1 for this module's tests only."""
    global pat, PagedAttentionError, paged_attention_triton
    with interpreted("shared.ops.paged_attention_triton") as (pat,):
        assert isinstance(pat._paged_attention_kernel, InterpretedFunction)
        PagedAttentionError, paged_attention_triton = pat.PagedAttentionError, pat.paged_attention_triton
        yield


def check(lens: list[tuple[int, int]], share: list[tuple[int, int, int]], h: int, kvh: int, dh: int, bs: int,
          block_n: int | None = None, dtype: torch.dtype = torch.float32, atol: float = 1e-4) -> None:
    q, k_cache, v_cache, meta = make_batch(lens, share, h, kvh, dh, bs, dtype)
    out = paged_attention_triton(q, k_cache, v_cache, meta, dh ** -0.5, block_n=block_n)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, dh ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("h,kvh,dh", [(2, 2, 64), (4, 2, 64), (6, 2, 64), (6, 3, 128)], ids=str)
def test_mixed_batch_matches_reference(h: int, kvh: int, dh: int) -> None:
    """GQA ratios 1, 2, 3 (3 pads the head group to 4 rows) over decodes, a prompt, a chunk and verifications;
    16-position KV steps so the online softmax rescales across several tiles."""
    check(MIXED, SHARE, h, kvh, dh, bs=16, block_n=16)


@pytest.mark.parametrize("bs,block_n", [(16, 16), (32, 32), (32, None)], ids=str)
def test_block_sizes_and_kv_tiles(bs: int, block_n: int | None) -> None:
    """One cache block per KV step (16 and 32 positions), and a 64-position KV tile spanning two 32-blocks."""
    check([(3, 1), (70, 1), (45, 7), (66, 4)], [(2, 1, 1)], 4, 2, 64, bs, block_n)


def test_decode_only_and_prefill_only() -> None:
    check([(1, 1), (33, 1), (64, 1), (5, 1)], [(2, 1, 2)], 4, 2, 64, bs=16)
    check([(9, 9), (24, 24)], [], 4, 2, 64, bs=16)


def test_long_verification_spans_query_tiles() -> None:
    """40 new tokens with G = 2: more than one query tile (32 rows each), the diagonal crossing KV tiles."""
    check([(12, 1), (71, 40)], [], 4, 2, 64, bs=16)


def test_bf16() -> None:
    check(MIXED[2:7], [], 4, 2, 64, bs=16, dtype=torch.bfloat16, atol=2e-2)


def test_strided_q_and_empty_step() -> None:
    q, k_cache, v_cache, meta = make_batch([(20, 1), (30, 5)], [], 4, 2, 64, 16)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)[:, :4]         # [T, H, Dh] with a stride of 2 H Dh per token
    torch.testing.assert_close(paged_attention_triton(qkv, k_cache, v_cache, meta, 0.125),
                               paged_attention_ref(q, k_cache, v_cache, meta, 0.125), rtol=0, atol=1e-4)
    empty = AttentionMetadata(torch.empty(0, dtype=torch.int64), torch.empty(0, 1, dtype=torch.int64),
                              torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, [], [], 0)
    assert paged_attention_triton(q[:0], k_cache, v_cache, empty, 0.125).shape == (0, 4, 64)


def test_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k_cache, v_cache, meta = make_batch([(5, 2)], [], 4, 2, 64, 16)
    with pytest.raises(PagedAttentionError, match="multiple of kv heads"):
        paged_attention_triton(q[:, :3], k_cache, v_cache, meta, 0.125)
    with pytest.raises(PagedAttentionError, match="dims"):
        paged_attention_triton(q[..., :32], k_cache, v_cache, meta, 0.125)
    with pytest.raises(PagedAttentionError, match="block_n"):
        paged_attention_triton(q, k_cache, v_cache, meta, 0.125, block_n=24)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(PagedAttentionError, match="CUDA"):
        paged_attention_triton(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("h,kvh", [(4, 2), (6, 2)], ids=str)
def test_draft_trees_match_reference(h: int, kvh: int) -> None:
    """Draft trees verified beside decodes and a 70-token prefill (rows past the 64 mask bits stay causal): a
    3-node tree, a 9-node one, and a 64-node one (65 rows: the last node's bit is the int64's sign bit), each
    against the reference with the same ancestor masks."""
    from shared.tree import ancestor_mask

    trees = {2: [-1, -1, 0], 4: random_parents(9, 2), 5: random_parents(64, 3)}
    lens = [(17, 1), (40, 1), (30, 4), (90, 70), (25, 10), (100, 65)]
    q, k_cache, v_cache, meta = make_batch(lens, [(5, 0, 1)], h, kvh, 64, 16)
    meta.tree_masks = {b: ancestor_mask(p) for b, p in trees.items()}
    assert meta.tree_masks[5][-1].sum() < 65                           # the masks differ from causal ones
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, block_n=32)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    meta.tree_masks, meta.tree_bits = {}, None                        # the same batch causal gives other rows
    causal = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, block_n=32)
    starts = meta.query_start_loc.tolist()
    for b in range(len(lens)):
        rows = slice(starts[b], starts[b + 1])
        if b in trees:
            assert not torch.allclose(causal[rows], out[rows], atol=1e-3)
        else:                                                          # the decodes and the prefill: the same
            torch.testing.assert_close(causal[rows], out[rows], rtol=0, atol=1e-4)


def test_tree_bits_and_tree_errors() -> None:
    from shared.tree import ancestor_mask

    q, k_cache, v_cache, meta = make_batch([(9, 1), (20, 4)], [], 4, 2, 64, 16)
    meta.tree_masks = {1: ancestor_mask([-1, 0, -1])}                  # nodes 1, 2 under the root, 3 under the root
    assert pat.tree_bits(meta).tolist() == [-1, 0b000, 0b001, 0b011, 0b100]
    q, k_cache, v_cache, meta = make_batch([(80, 66)], [], 4, 2, 64, 16)
    meta.tree_masks = {0: ancestor_mask(list(range(-1, 64)))}        # 65 nodes: 66 rows, past the kernel's bits
    with pytest.raises(PagedAttentionError, match="at most 65"):
        paged_attention_triton(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window_matches_reference(window: int) -> None:
    """Decodes, a prompt, a chunk, verifications and a 10-row draft tree under a sliding window (the KV tiles
    before every row's window are skipped; a tree node's position is its root's plus its depth)."""
    from shared.tree import ancestor_mask

    lens = [(1, 1), (17, 1), (40, 1), (20, 20), (50, 13), (37, 4), (33, 10), (90, 30)]
    q, k_cache, v_cache, meta = make_batch(lens, [], 4, 2, 64, 16)
    meta.tree_masks = {6: ancestor_mask(random_parents(9, 4))}
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, block_n=16, window=window)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    assert not torch.allclose(out, paged_attention_triton(q, k_cache, v_cache, meta, 0.125, block_n=16),
                              atol=1e-3), "the window changed nothing"


@pytest.mark.parametrize("window", [None, 16])
def test_soft_capped_scores_match_reference(window) -> None:
    """Gemma 2's cap tanh(s / cap) on the scores, alone and with a sliding window, over a mixed batch and a tree."""
    from shared.tree import ancestor_mask

    lens = [(17, 1), (40, 1), (20, 20), (37, 4), (33, 10)]
    q, k_cache, v_cache, meta = make_batch(lens, [], 4, 2, 64, 16)
    q = q * 4
    meta.tree_masks = {4: ancestor_mask(random_parents(9, 4))}
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, block_n=16, window=window, softcap=2.0)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, window, 2.0)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
