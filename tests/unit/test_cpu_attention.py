"""The C paged attention and RoPE + KV store (shared/ops/cpu_attention.c) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from shared.ops import cpu_attention
from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref, write_kv
from shared.ops.rope import apply_rope
from shared.tree import ancestor_mask

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the C attention kernel does not build here")
PATHS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(not cpu_attention.avx512_default(),
                                                                  reason="no AVX512-BF16 here"))]


@pytest.fixture(params=PATHS)
def path(request):
    """The bf16 cache's path for the test (fp32 always takes the AVX2 one); the default is restored after."""
    cpu_attention.set_avx512(request.param == "avx512")
    yield request.param
    cpu_attention.set_avx512(cpu_attention.avx512_default())


def make_step(lens: list[int], qlens: list[int], nb: int, bs: int, trees: dict[int, list[int]] | None = None,
              seed: int = 0) -> AttentionMetadata:
    """Sequences with their own shuffled blocks; decodes (qlen 1) first, as the scheduler orders them."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, slots, starts = [], [], [0]
    for length, n in zip(lens, qlens):
        need = -(-length // bs)
        table, perm = perm[:need], perm[need:]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(length - n, length)]
        starts.append(starts[-1] + n)
    mb = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (mb - len(t)) for t in tables]),
        seq_lens=torch.tensor(lens), query_start_loc=torch.tensor(starts),
        num_decodes=sum(1 for n in qlens if n == 1), query_lens=qlens, seq_lens_host=lens, max_query_len=max(qlens),
        tree_masks={b: ancestor_mask(p) for b, p in (trees or {}).items()})


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("h,kvh,dh", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 2, 72)])   # 72: 9 lanes of 8
def test_matches_reference(dtype, tol, h, kvh, dh, path):
    # three decodes, a 9-row chain (verification), an 8-node tree, a 70-token prefill (left to the reference)
    lens, qlens = [40, 3, 17, 30, 25, 90], [1, 1, 1, 9, 9, 70]
    meta = make_step(lens, qlens, nb=64, bs=16, trees={4: [-1, -1, 0, 0, 1, 2, 4, 6]})
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(64, 16, kvh, dh, generator=g).to(dtype)
    vc = torch.randn(64, 16, kvh, dh, generator=g).to(dtype)
    q = torch.randn(sum(qlens), h, dh, generator=g).to(dtype)
    got = cpu_attention.paged_attention(q, kc, vc, meta, dh ** -0.5)
    want = paged_attention_ref(q, kc, vc, meta, dh ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_their_neighbours(dtype, path):
    """A sequence's decode row gives the same bits alone and beside other sequences; a verification row of a chain
    gives the bits of the decode row at its position."""
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(32, 16, 3, 64, generator=g).to(dtype), torch.randn(32, 16, 3, 64, generator=g).to(dtype)
    q = torch.randn(6, 9, 64, generator=g).to(dtype)
    batch = make_step([50, 20, 33], [1, 1, 4], nb=32, bs=16, seed=3)
    out = cpu_attention.paged_attention(q, kc, vc, batch, 0.125)
    alone = AttentionMetadata(batch.slot_mapping[:1], batch.block_tables[:1], batch.seq_lens[:1],
                              torch.tensor([0, 1]), 1, [1], [50], 1)
    assert torch.equal(cpu_attention.paged_attention(q[:1], kc, vc, alone, 0.125), out[:1])
    # row 2 of the 4-row chain of sequence 2 stands at position 31: the decode of a 32-token sequence
    decode = AttentionMetadata(batch.slot_mapping[:1], batch.block_tables[2:3], torch.tensor([32]),
                               torch.tensor([0, 1]), 1, [1], [32], 1)
    assert torch.equal(cpu_attention.paged_attention(q[4:5], kc, vc, decode, 0.125), out[4:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_splits_its_query_heads_without_changing_a_bit(dtype, path):
    """One sequence's step (a decode, a chain, a tree) has fewer (rows, kv head) items than two per thread, so each
    query head is an item of its own: the same bits as the same rows beside another sequence, close to the
    reference."""
    g = torch.Generator().manual_seed(4)
    kc, vc = torch.randn(32, 16, 3, 64, generator=g).to(dtype), torch.randn(32, 16, 3, 64, generator=g).to(dtype)
    for qlen, tree in ((1, None), (5, None), (6, [-1, -1, 0, 0, 2])):
        trees = {1: tree} if tree else None
        both = make_step([40, 60], [1, qlen], nb=32, bs=16, trees=trees, seed=5)
        q = torch.randn(1 + qlen, 9, 64, generator=g).to(dtype)
        out = cpu_attention.paged_attention(q, kc, vc, both, 0.125)
        alone = AttentionMetadata(both.slot_mapping[1:], both.block_tables[1:], both.seq_lens[1:],
                                  torch.tensor([0, qlen]), int(qlen == 1), [qlen], [60], qlen,
                                  tree_masks={0: both.tree_masks[1]} if tree else {})
        got = cpu_attention.paged_attention(q[1:], kc, vc, alone, 0.125)
        assert torch.equal(got, out[1:])
        want = paged_attention_ref(q[1:], kc, vc, alone, 0.125)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("rot", [64, 32, 16])                                  # all dims, then partial rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_equals_apply_rope_and_write_kv(dtype, rot, isa):
    if cpu_attention.rope_avx512(isa == "avx512") != (isa == "avx512"):
        pytest.skip("no AVX-512 here")
    g = torch.Generator().manual_seed(4)
    t, h, kvh, dh = 7, 9, 3, 64
    wide = torch.randn(t, (h + 2 * kvh) * dh + 8, generator=g).to(dtype)
    qkv = wide[:, :(h + 2 * kvh) * dh]                                          # rows strided, as a fused GEMM's
    cos, sin = torch.randn(t, rot, generator=g).to(dtype), torch.randn(t, rot, generator=g).to(dtype)
    slots = torch.tensor([5, 9, 17, 18, 40, 41, 2])
    k1, v1 = torch.zeros(4, 16, kvh, dh, dtype=dtype), torch.zeros(4, 16, kvh, dh, dtype=dtype)
    k2, v2 = k1.clone(), v1.clone()
    q, k, v = qkv.split([h * dh, kvh * dh, kvh * dh], dim=-1)
    want_q = apply_rope(q.reshape(t, h, dh), cos, sin)
    write_kv(k1, v1, apply_rope(k.reshape(t, kvh, dh), cos, sin), v.reshape(t, kvh, dh), slots)
    got = wide.clone()
    try:
        cpu_attention.rope_store(got[:, :(h + 2 * kvh) * dh], cos, sin, k2, v2, slots, h, kvh, dh)
    finally:
        cpu_attention.rope_avx512(True)
    assert torch.equal(got[:, :h * dh].view(t, h, dh), want_q)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(got[:, (h + kvh) * dh:], wide[:, (h + kvh) * dh:])     # v is read, never rotated


def test_supports_refuses_what_it_cannot_compute():
    kc = torch.zeros(2, 16, 1, 64)
    assert cpu_attention.supports(torch.zeros(1, 8, 64), kc)
    assert not cpu_attention.supports(torch.zeros(1, 16, 64), kc)               # 16 query heads per KV head
    assert not cpu_attention.supports(torch.zeros(1, 8, 64, dtype=torch.float16), kc.half())
    assert not cpu_attention.supports(torch.zeros(1, 8, 64, dtype=torch.bfloat16), kc)   # cache of another dtype
