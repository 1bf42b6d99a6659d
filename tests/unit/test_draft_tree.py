"""Draft trees: the tree helpers, tree-masked paged attention against a dense reference, and the engine verifying
trees (KV compaction of the accepted path, hidden states of the path) with output equal to plain greedy."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.proposal import Proposal
from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref
from shared.sampling_params import SamplingParams
from shared.spec.proposers import prompt_lookup
from shared.tree import ancestor_mask, check_tree, compaction, depths, graft_chain, is_chain, walk_greedy
from shared.testing.tiny_llama import PROMPTS

# The tree of shared/tree.py's docstring: a, b under the root; c under a, d under b, e under c.
PARENTS = [-1, -1, 0, 1, 2]


def test_depths_mask_and_checks():
    assert depths(PARENTS) == [1, 1, 2, 2, 3]
    m = ancestor_mask(PARENTS).int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0],      # root
                 [1, 1, 0, 0, 0, 0],      # a
                 [1, 0, 1, 0, 0, 0],      # b
                 [1, 1, 0, 1, 0, 0],      # c: root, a, c
                 [1, 0, 1, 0, 1, 0],      # d: root, b, d
                 [1, 1, 0, 1, 0, 1]]      # e: root, a, c, e
    assert is_chain(None) and is_chain([-1, 0, 1]) and not is_chain(PARENTS)
    check_tree(PARENTS, 5)
    for bad, n in (([-1, 1], 2), ([-1, -2], 2), ([-1, 0], 3)):
        with pytest.raises(ValueError):
            check_tree(bad, n)


def test_graft_chain_follows_matching_nodes_and_appends_the_rest():
    tokens = [4, 5, 6, 7, 8]                                      # a=4, b=5, c=6, d=7, e=8 (PARENTS)
    # 4, 6 are nodes a, c; 9 and 3 are new: children of c, then of the new 9
    assert graft_chain(tokens, PARENTS, [4, 6, 9, 3], 4) == (tokens + [9, 3], PARENTS + [2, 5])
    assert graft_chain(tokens, PARENTS, [4, 6, 9, 3], 1) == (tokens + [9], PARENTS + [2])     # at most max_new
    assert graft_chain(tokens, PARENTS, [5, 7], 4) == (tokens, PARENTS)                        # already there
    assert graft_chain(tokens, PARENTS, [1, 2], 4) == (tokens + [1, 2], PARENTS + [-1, 5])     # from the root
    assert graft_chain([], [], [1, 2], 4) == ([1, 2], [-1, 0])
    new_tokens, new_parents = graft_chain(tokens, PARENTS, [4, 9], 4)
    check_tree(new_parents, len(new_tokens))
    # prompt lookup: the latest earlier occurrence of the last 3, else 2 (min_n) tokens
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    assert prompt_lookup(seq, 3) == [7, 8, 2] and prompt_lookup(seq[:7], 2) == [9, 1]      # [2, 3]; [1, 2, 3]
    assert prompt_lookup([5, 6, 7, 6], 2) == [7, 6] and prompt_lookup([5, 6, 7, 6], 2, min_n=2) == []


def _logits(best: list[int], vocab: int = 10) -> torch.Tensor:
    return F.one_hot(torch.tensor(best), vocab).float()           # row r's argmax is best[r]


def test_walk_greedy_follows_the_targets_argmax_through_the_tree():
    tokens = [4, 5, 6, 7, 8]                                      # a=4, b=5, c=6, d=7, e=8
    # root -> 5 (b), b -> 7 (d), d -> 3 (no such child): path b, d, then 3
    assert walk_greedy(_logits([5, 0, 7, 0, 3, 0]), tokens, PARENTS) == ([1, 3], 3)
    # root -> 4 (a), a -> 6 (c), c -> 8 (e), e -> 2: the whole deepest branch, then the bonus token
    assert walk_greedy(_logits([4, 6, 0, 8, 0, 2]), tokens, PARENTS) == ([0, 2, 4], 2)
    assert walk_greedy(_logits([9, 6, 0, 8, 0, 2]), tokens, PARENTS) == ([], 9)       # nothing accepted
    assert compaction([1, 3]) == [(2, 1), (4, 2)]
    assert compaction([0, 2, 4]) == [(3, 2), (5, 3)]
    assert compaction([0, 1]) == []


def _dense_tree_attention(q, k_ctx, v_ctx, k_new, v_new, parents, scale):
    """Each new row attends to the whole context, the root and its own ancestors, computed one row at a time."""
    out = []
    anc = ancestor_mask(parents)
    for j in range(len(parents) + 1):
        keys = torch.cat([k_ctx, k_new[anc[j]]])                                # [L_j, KVH, Dh]
        vals = torch.cat([v_ctx, v_new[anc[j]]])
        rep = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)   # [L_j, H, Dh]
        w = torch.einsum("hd,lhd->hl", q[j], keys) * scale
        out.append(torch.einsum("hl,lhd->hd", w.softmax(-1), vals))
    return torch.stack(out)                                                   # [N + 1, H, Dh]


@pytest.mark.parametrize("layout", ["alone", "short-batch", "long"])
def test_tree_masked_paged_attention_equals_a_dense_reference(layout):
    g = torch.Generator().manual_seed(0)
    h, kvh, dh, bs, nb = 4, 2, 8, 4, 64
    k_cache, v_cache = torch.randn(nb, bs, kvh, dh, generator=g), torch.randn(nb, bs, kvh, dh, generator=g)
    trees = {"alone": [PARENTS], "short-batch": [PARENTS, [-1, 0, 0, -1]],
             "long": [[-1] + [i // 2 for i in range(18)]]}[layout]                  # 19 nodes: past SHORT
    ctx_lens = [11, 6][:len(trees)]
    tables = [random.Random(b).sample(range(nb), 16) for b in range(len(trees))]
    qs, seq_lens, qlens = [], [], []
    for parents, ctx in zip(trees, ctx_lens):
        n = len(parents) + 1
        qs.append(torch.randn(n, h, dh, generator=g))
        seq_lens.append(ctx + n)
        qlens.append(n)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=torch.tensor(tables),
        seq_lens=torch.tensor(seq_lens), query_start_loc=torch.tensor(starts), num_decodes=0, query_lens=qlens,
        seq_lens_host=seq_lens, max_query_len=max(qlens),
        tree_masks={b: ancestor_mask(p) for b, p in enumerate(trees)})
    out = paged_attention_ref(torch.cat(qs), k_cache, v_cache, meta, 0.3)
    flat_k, flat_v = k_cache.view(nb * bs, kvh, dh), v_cache.view(nb * bs, kvh, dh)
    for b, (parents, ctx) in enumerate(zip(trees, ctx_lens)):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(seq_lens[b])])
        keys, vals = flat_k[slots], flat_v[slots]
        want = _dense_tree_attention(qs[b], keys[:ctx], vals[:ctx], keys[ctx:], vals[ctx:], parents, 0.3)
        torch.testing.assert_close(out[starts[b]:starts[b + 1]], want, rtol=1e-5, atol=1e-5)


class ScriptedTrees:
    """Proposes, for greedy sequences, a random tree in which the plain greedy continuation is one branch
    (cut at a random depth, so some verifications accept all of it and some stop early), among wrong branches;
    sampled sequences get a tree too, which the engine must refuse. Records the hidden states it is handed."""

    wants_hidden = True

    def __init__(self, greedy: dict[int, list[int]], vocab: int, seed: int) -> None:
        self.greedy, self.vocab, self.rng = greedy, vocab, random.Random(seed)
        self.hidden: dict[int, dict[int, torch.Tensor]] = {}
        self.trees = 0

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            truth = self.greedy.get(s.num_prompt_tokens, [])[s.num_output_tokens:][:k]
            cut = self.rng.randint(0, len(truth))
            tokens, parents = [], []
            # wrong branches first, the (partly) right branch somewhere among them: its nodes move on acceptance
            for branch in range(self.rng.randint(2, 3)):       # two or more: never a chain
                parent = -1
                for d in range(self.rng.randint(1, k)):
                    tokens.append((truth[d] + 1 + branch) % self.vocab if d < len(truth) else self.rng.randrange(5))
                    parents.append(parent)
                    parent = len(tokens) - 1
                    if self.rng.random() < 0.5:
                        break
            parent = -1
            for d in range(cut):
                tokens.append(truth[d])
                parents.append(parent)
                parent = len(tokens) - 1
                if self.rng.random() < 0.4 and d + 1 < k:               # a wrong sibling below this node
                    tokens.append((truth[d + 1] + 7) % self.vocab if d + 1 < len(truth) else 1)
                    parents.append(parent)
            out.append(Proposal(tokens, None, parents))
            self.trees += 1
        return out

    def accept_hidden(self, seq, start, hidden):
        rows = self.hidden.setdefault(seq.num_prompt_tokens, {})
        for i, row in enumerate(hidden):
            rows[start + i] = row.clone()

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 8])
def test_engine_verifies_trees_exactly(tiny, k, batch):
    prompts = PROMPTS[:batch]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4))
    want = [o[0] for o in plain.generate(prompts, params)]
    # the plain run's hidden states of every position (prompt + output but the last token), teacher-forced
    ref_hidden = plain.hidden_states([p + o[:-1] for p, o in zip(prompts, want)])
    eng = LLMEngine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4,
                                 num_speculative_tokens=k))
    eng.proposer = prop = ScriptedTrees({len(p): o for p, o in zip(prompts, want)}, 96, seed=k * 10 + batch)
    got = [o[0] for o in eng.generate(prompts, params)]
    assert got == want
    assert prop.trees > 0 and eng.stats_accepted > 0 and eng.stats_accepted < eng.stats_draft
    assert eng.block_manager.num_used_blocks == 0
    for p, ref in zip(prompts, ref_hidden):          # the hidden states handed over are those of the accepted path
        rows = prop.hidden[len(p)]
        assert len(rows) >= len(ref) - k - 1             # all but the last step's (the sequence finished)
        for pos, row in rows.items():
            torch.testing.assert_close(row, ref[pos], rtol=1e-4, atol=1e-4)


def test_sampled_sequences_refuse_trees(tiny):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4))
    want = plain.generate(PROMPTS[:2], params)
    eng = LLMEngine(EngineConfig(model=tiny, progress=False, num_kv_blocks=128, block_size=4,
                                 num_speculative_tokens=3))
    eng.proposer = prop = ScriptedTrees({len(p): o[0] for p, o in zip(PROMPTS, want)}, 96, seed=1)
    assert eng.generate(PROMPTS[:2], params) == want           # no speculation: the same seeded samples
    assert prop.trees > 0 and eng.stats_draft == 0
    assert eng.block_manager.num_used_blocks == 0


def test_a_tree_that_does_not_fit_is_dropped_before_any_sequence_is_preempted():
    from shared.engine.scheduler import Scheduler
    from shared.engine.sequence import Sequence
    from shared.kv.block_manager import BlockManager
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=50)
    old, new = Sequence("a", 0, list(range(1, 8)), params), Sequence("b", 0, list(range(1, 9)), params)
    for s in (old, new):
        sched.add(s)
    sched.schedule()                                              # both prefilled: 2 + 2 blocks of 6
    for s in (old, new):
        s.num_computed_tokens = len(s)
        s.token_ids.append(20)                                    # one new token each
    old.token_ids += list(range(30, 42))                          # a tree of 12 nodes: needs 3 more blocks
    old.spec_tokens, old.spec_parents = list(range(30, 42)), [-1] * 12
    batch = sched.schedule()
    assert new in batch.seqs and old in batch.seqs and sched.num_preemptions == 0
    assert old.spec_tokens == [] and old.spec_parents is None and old.token_ids[-1] == 20
    assert batch.num_tokens == [1, 1]                             # both decode plainly
