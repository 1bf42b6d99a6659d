"""Sliding-window attention (Mistral, Phi-3, Gemma's local layers) and soft-capped scores (Gemma 2): the torch
reference against a plain loop over each row's attended positions, and the C kernel against the reference, over
decodes, chains, draft trees and a long prefill; a verification row keeps the bits of the decode row it stands
for."""
from __future__ import annotations

import pytest
import torch

from shared.ops import cpu_attention
from shared.ops.paged_attention import paged_attention_ref
from shared.tree import ancestor_mask
from shared.testing.paged_batches import make_batch, random_parents

# decodes, a prompt, a chunk after cached context, verifications, a 70-token prefill (past the C kernel's rows)
LENS = [(1, 1), (17, 1), (40, 1), (20, 20), (50, 13), (37, 4), (33, 10), (90, 70)]
TREES = {6: random_parents(9, 4)}


def naive(q, k_cache, v_cache, meta, scale, window):
    """Every row on its own, in float64: the positions it attends (causal or its tree, and the window)."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for b, (n, length) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
        table = meta.block_tables[b].tolist()
        slots = [table[p // bs] * bs + p % bs for p in range(length)]
        k = k_cache.reshape(-1, kvh, k_cache.shape[-1])[slots].double()          # [L, KVH, Dh]
        v = v_cache.reshape(-1, kvh, v_cache.shape[-1])[slots].double()
        tree = meta.tree_masks.get(b)
        c = length - n                                                   # the first new token's position
        real = list(range(c)) + ([c + j for j in range(n)] if tree is None else
                                 [c + int(tree[j].sum()) - 1 for j in range(n)])   # a tree node: root + depth
        for j in range(n):
            p = real[c + j]                                              # this row's own position
            if tree is None:
                seen = [i for i in range(c + j + 1)]
            else:
                seen = list(range(c)) + [c + i for i in range(n) if tree[j, i]]
            keep = [i for i in seen if p - window < real[i] <= p]
            for h in range(q.shape[1]):
                s = (k[keep, h // g] @ q[start + j, h].double()) * scale
                out[start + j, h] = torch.softmax(s, 0) @ v[keep, h // g]
        start += n
    return out


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_reference_matches_a_plain_loop(window):
    q, kc, vc, meta = make_batch(LENS, [], 6, 2, 16, 16)
    meta.tree_masks = {b: ancestor_mask(p) for b, p in TREES.items()}
    got = paged_attention_ref(q, kc, vc, meta, 0.25, window)
    torch.testing.assert_close(got.double(), naive(q, kc, vc, meta, 0.25, window), rtol=1e-5, atol=1e-5)
    full = paged_attention_ref(q, kc, vc, meta, 0.25, 1000)               # a window past every sequence: no window
    torch.testing.assert_close(full, paged_attention_ref(q, kc, vc, meta, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="the C attention kernel does not build here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_c_kernel_matches_reference(dtype, tol, window):
    q, kc, vc, meta = make_batch(LENS, [], 9, 3, 64, 16, dtype)
    meta.tree_masks = {b: ancestor_mask(p) for b, p in TREES.items()}
    got = cpu_attention.paged_attention(q, kc, vc, meta, 0.125, window)
    want = paged_attention_ref(q, kc, vc, meta, 0.125, window)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert not torch.allclose(got.float(), cpu_attention.paged_attention(q, kc, vc, meta, 0.125).float(),
                              atol=1e-3), "the window changed nothing"


@pytest.mark.skipif(not cpu_attention.available(), reason="the C attention kernel does not build here")
def test_c_kernel_verification_row_equals_its_decode_row_under_a_window():
    """A 6-token chain verified at once against the same positions decoded one at a time: the same bits."""
    q, kc, vc, meta = make_batch([(45, 6)], [], 8, 2, 32, 16)
    chain = cpu_attention.paged_attention(q, kc, vc, meta, 0.2, 7)
    for j in range(6):
        one = make_batch([(45, 6)], [], 8, 2, 32, 16)[3]
        one.query_lens, one.seq_lens_host, one.max_query_len, one.num_decodes = [1], [40 + j], 1, 1
        one.seq_lens = torch.tensor([40 + j])
        one.query_start_loc = torch.tensor([0, 1])
        one.slot_mapping = meta.slot_mapping[j:j + 1]
        row = cpu_attention.paged_attention(q[j:j + 1], kc, vc, one, 0.2, 7)
        assert torch.equal(row[0], chain[j])


@pytest.mark.skipif(not cpu_attention.available(), reason="the C attention kernel does not build here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 16])
def test_c_kernel_soft_caps_scores_as_the_reference(dtype, tol, window):
    """Gemma 2's cap tanh(s / cap) on the scores, alone and with a window, in the C kernel and the reference."""
    q, kc, vc, meta = make_batch(LENS, [], 9, 3, 64, 16, dtype)
    q = q * 4                                                            # scores large enough for the cap to bite
    meta.tree_masks = {b: ancestor_mask(p) for b, p in TREES.items()}
    got = cpu_attention.paged_attention(q, kc, vc, meta, 0.125, window, 2.0)
    want = paged_attention_ref(q, kc, vc, meta, 0.125, window, 2.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert not torch.allclose(got.float(), cpu_attention.paged_attention(q, kc, vc, meta, 0.125, window).float(),
                              atol=1e-2), "the cap changed nothing"
