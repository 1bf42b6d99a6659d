"""The EAGLE head's bookkeeping: reduced-vocab id map, q in the full vocab, and its per-sequence KV with rollback
matching a dense causal pass over the whole sequence."""
from __future__ import annotations

import pytest
import torch

from services.draft_data import reduced_vocab
from shared.engine.sequence import Sequence
from shared.model.llama import RMSNorm
from shared.sampling_params import SamplingParams
from shared.spec.eagle import EagleConfig, EagleHead
from shared.spec.eagle_proposer import EagleProposer

V, D, N = 40, 32, 12


def tiny_head(seed: int = 0, post_norm: bool = False) -> EagleHead:
    torch.manual_seed(seed)
    cfg = EagleConfig(hidden_size=D, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_theta=10000.0, vocab_size=V, draft_vocab_size=N, max_position=128, post_norm=post_norm)
    head = EagleHead(cfg).eval()
    head.id_map = torch.randperm(V)[:N].sort().values
    norm = RMSNorm(D, 1e-6)
    norm.weight.data = torch.rand(D) + 0.5
    head.attach_target(torch.randn(V, D), norm, torch.randn(V, D) * 3)
    return head


def dense(head: EagleHead, feats: torch.Tensor, tokens: list[int]):
    """The head over the whole sequence at once: pairs (f_p, x_{p+1}), p = 0 .. L - 2."""
    from shared.spec.eagle import causal_mask
    n = len(tokens) - 1
    with torch.inference_mode():
        out, k, v = head(feats[None, :n], torch.tensor([tokens[1:]]), torch.arange(n)[None], None,
                         causal_mask([0], [n], feats.device))
    return out[0], k[0]


def test_reduced_vocab_keeps_the_most_frequent_tokens_and_eos():
    seqs = [[5, 5, 5, 7, 7, 1], [5, 7, 2, 2, 2, 2]]
    assert reduced_vocab(seqs, 3, 10, always=[9]).tolist() == [2, 5, 9]      # 2: x4, 5: x4, then EOS over 7: x3


def test_sampled_q_is_the_reduced_distribution_scattered_into_the_full_vocab():
    head = tiny_head()
    prop = EagleProposer(head)
    tokens = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence("r", 0, tokens, SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=50))
    prop.accept_hidden(seq, 0, torch.randn(8, D))
    drafted, q, _ = prop.propose([seq], [3])[0]
    assert len(drafted) == 3 and q.shape == (3, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.id_map] = False
    assert (q[:, outside] == 0).all() and torch.allclose(q.sum(-1), torch.ones(3))
    assert ((q > 0).sum(-1) <= 5).all()                                       # top-k shaped
    assert all(q[i, t] > 0 for i, t in enumerate(drafted))
    assert set(drafted) <= set(head.id_map.tolist())


def test_incremental_kv_with_rollback_equals_a_dense_pass():
    head = tiny_head()
    prop = EagleProposer(head)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (20,), generator=g).tolist()
    feats = torch.randn(20, D, generator=g)
    out_ref, k_ref = dense(head, feats, tokens)
    greedy = SamplingParams(temperature=0, max_tokens=50)

    def first_draft(upto: int) -> int:             # what the head drafts after real features 0 .. upto - 2
        return int(head.id_map[head.logits(out_ref[upto - 2]).argmax()])

    seq = Sequence("r", 0, tokens[:8], greedy)
    prop.accept_hidden(seq, 0, feats[:7])                                   # a prefill of 7 positions
    drafted, q, _ = prop.propose([seq], [4])[0]
    assert q is None and len(drafted) == 4 and drafted[0] == first_draft(8)
    st = prop.states[seq.seq_id]
    assert st.real == 7 and len(st.k) == 7 + 3                             # 3 draft positions on top
    seq.token_ids = tokens[:11]                                             # the target accepted 2, emitted 1
    prop.accept_hidden(seq, 7, feats[7:10])
    drafted = prop.propose([seq], [2])[0].tokens
    assert drafted[0] == first_draft(11)
    assert torch.allclose(st.k[:10], k_ref[:10], atol=1e-5)                 # draft KV rolled back, redone for real
    seq.token_ids = tokens[:15]                                             # preempted and recomputed from 4
    prop.accept_hidden(seq, 4, feats[4:14])
    drafted = prop.propose([seq], [1])[0].tokens
    assert st is not prop.states.get(seq.seq_id) or st.real == 14
    assert drafted == [first_draft(15)]
    assert torch.allclose(prop.states[seq.seq_id].k[:14], k_ref[:14], atol=1e-5)
    prop.release(seq.seq_id)
    assert not prop.states


def test_batched_proposals_equal_one_sequence_at_a_time():
    head = tiny_head()
    g = torch.Generator().manual_seed(4)
    greedy = SamplingParams(temperature=0, max_tokens=50)
    seqs, feats = [], []
    for n in (5, 13, 9):
        seqs.append(Sequence("r", 0, torch.randint(0, V, (n,), generator=g).tolist(), greedy))
        feats.append(torch.randn(n - 1, D, generator=g))
    batched = EagleProposer(head)
    for s, f in zip(seqs, feats):
        batched.accept_hidden(s, 0, f)
    together = batched.propose(seqs, [3, 1, 4])
    for s, f, (toks, _, _), k in zip(seqs, feats, together, [3, 1, 4]):
        alone = EagleProposer(head)
        alone.accept_hidden(s, 0, f)
        assert alone.propose([s], [k])[0][0] == toks and len(toks) == k


@pytest.mark.parametrize("post_norm", [False, True])
def test_drafts_follow_the_eagle_recurrence(post_norm):
    """K drafts = EAGLE-1 written out: features of the target's hidden states (after its final norm for post_norm
    heads), pairs (f_p, x_{p+1}) at position p; then each predicted feature goes back in with the token it drafted, at
    the next position; the LM head reads the features directly (post_norm) or after the target's norm."""
    head = tiny_head(5, post_norm)
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, V, (12,), generator=g).tolist()
    hidden = torch.randn(11, D, generator=g) * 4                            # the target's, before its final norm
    feats = RMSNorm(D, 1e-6)(hidden) * head.final_norm.weight if post_norm else hidden
    with torch.inference_mode():
        n = 11
        out, k, v = head(feats[None], torch.tensor([tokens[1:]]), torch.arange(n)[None], None,
                         torch.ones(1, n, n).tril().bool())
        last, want = out[0, -1], []
        for step in range(4):
            logits = last @ head.head_rows.T if post_norm else head.final_norm(last) @ head.head_rows.T
            want.append(int(head.id_map[logits.argmax()]))
            o, k1, v1 = head(last[None, None], torch.tensor([[want[-1]]]), torch.tensor([[n + step]]), (k, v),
                             torch.ones(1, 1, n + step + 1, dtype=torch.bool))
            k, v, last = torch.cat([k, k1], 1), torch.cat([v, v1], 1), o[0, 0]
    prop = EagleProposer(head)
    seq = Sequence("r", 0, tokens, SamplingParams(temperature=0, max_tokens=50))
    prop.accept_hidden(seq, 0, hidden[:6])                                  # in two pieces, as the engine hands them
    prop.accept_hidden(seq, 6, hidden[6:])
    assert prop.propose([seq], [4])[0][0] == want
    st = prop.states[seq.seq_id]                       # the drafts' keys: same features, tokens and positions
    assert st.real == n and torch.allclose(st.k, k[0, :n + 3], atol=1e-5)


@pytest.mark.parametrize("theta", [0.0, 0.05, 0.3, 0.9])
def test_a_draft_stops_where_its_path_probability_falls_below_the_confidence(theta):
    """min_confidence: the drafts are the first tokens of the K the head would draft, as many as keep the product of
    the head's own probabilities (softmax over the reduced vocab) at or above theta; the first is always drafted.
    In a batch every row stops on its own, and a sampled row keeps q for each of its drafts."""
    head = tiny_head(7)
    g = torch.Generator().manual_seed(8)
    greedy = SamplingParams(temperature=0, max_tokens=50)
    seqs, feats = [], []
    for n in (6, 11, 9, 14):
        seqs.append(Sequence("r", 0, torch.randint(0, V, (n,), generator=g).tolist(), greedy))
        feats.append(torch.randn(n - 1, D, generator=g) * 3)
    full, confs = [], []
    for s, f in zip(seqs, feats):                        # reference: all K drafts, and each one's probability
        prop = EagleProposer(head)
        prop.accept_hidden(s, 0, f)
        logits = []
        head_logits = head.logits
        head.logits = lambda x: logits.append(head_logits(x)) or logits[-1]
        try:
            full.append(prop.propose([s], [5])[0][0])
        finally:
            del head.logits
        confs.append([float(lg.softmax(-1).max()) for lg in logits])
    want = []
    for toks, c in zip(full, confs):
        n, path = 1, c[0]
        while n < len(toks) and path * c[n] >= theta:
            path *= c[n]
            n += 1
        want.append(toks[:n])
    prop = EagleProposer(head, min_confidence=theta)
    for s, f in zip(seqs, feats):
        prop.accept_hidden(s, 0, f)
    got = [p.tokens for p in prop.propose(seqs, [5] * len(seqs))]
    assert got == want
    if theta == 0.0:
        assert all(len(t) == 5 for t in got)
    if theta == 0.3:                                    # the setting matters here: some rows stop early, some not
        assert len({len(t) for t in got}) > 1
    sampled = Sequence("s", 0, seqs[1].token_ids, SamplingParams(temperature=0.8, seed=1, max_tokens=50))
    prop.accept_hidden(sampled, 0, feats[1])
    toks, q, _ = prop.propose([sampled], [5])[0]
    assert 1 <= len(toks) <= 5 and q.shape == (len(toks), V)


def test_draft_confidence_comes_from_serving_unless_set(tmp_path):
    """The head describes the model; how it drafts is serving's (SERVING, or the flags). A head saved with the
    serving keys older heads carried in eagle.json still loads, and those keys are ignored."""
    import json

    from shared.engine.config import check_draft_confidence
    from shared.spec.eagle_proposer import SERVING, make_eagle
    head = tiny_head()
    head.save(str(tmp_path / "h"))
    saved = json.loads((tmp_path / "h" / "eagle.json").read_text())
    assert not {"draft_confidence", "tree_nodes", "tree_width", "tree_ngram"} & set(saved)
    (tmp_path / "h" / "eagle.json").write_text(json.dumps(saved | {"draft_confidence": 0.2, "tree_nodes_fp32": 5}))
    target = torch.nn.Module()
    target.embed_tokens, target.norm, target.lm_head = torch.nn.Embedding(V, D), head.final_norm, torch.nn.Linear(D, V)
    assert make_eagle(str(tmp_path / "h"), torch.float32, torch.device("cpu"), target, None).min_confidence == \
        SERVING.confidence
    assert make_eagle(str(tmp_path / "h"), torch.float32, torch.device("cpu"), target, None, 0.0).min_confidence == 0
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="draft_confidence"):
            check_draft_confidence(bad)
        with pytest.raises(ValueError, match="confidence"):
            EagleProposer(head, bad)


def test_tree_settings_come_from_serving_unless_set_and_bad_ones_are_refused(tmp_path):
    from services.draft.config import DraftConfig
    from services.launcher import ServeConfig
    from services.target.config import TargetConfig
    from shared.engine.config import EngineConfig
    from shared.spec.eagle_proposer import SERVING, make_eagle
    head = tiny_head()
    head.save(str(tmp_path / "h"))
    target = torch.nn.Module()
    target.embed_tokens, target.norm, target.lm_head = torch.nn.Embedding(V, D), head.final_norm, torch.nn.Linear(D, V)
    own = make_eagle(str(tmp_path / "h"), torch.float32, torch.device("cpu"), target, None)
    assert (own.tree_nodes, own.tree_width, own.tree_ngram) == (SERVING.tree_nodes, SERVING.tree_width,
                                                                SERVING.tree_ngram)
    chains = make_eagle(str(tmp_path / "h"), torch.float32, torch.device("cpu"), target, None, tree_nodes=0)
    assert chains.tree_nodes == 0
    seven = make_eagle(str(tmp_path / "h"), torch.float32, torch.device("cpu"), target, None, tree_nodes=7,
                       tree_ngram=0)
    assert (seven.tree_nodes, seven.tree_ngram) == (7, 0)
    for make in (lambda: EngineConfig(draft_tree_nodes=-1), lambda: EngineConfig(draft_tree_nodes=65),
                 lambda: TargetConfig(draft_tree_nodes=-1), lambda: EngineConfig(draft_tree_ngram=-1),
                 lambda: DraftConfig(draft_tree_nodes=-1), lambda: ServeConfig(draft_tree_nodes=-1),
                 lambda: TargetConfig(draft_tree_ngram=-1), lambda: DraftConfig(draft_tree_ngram=-1),
                 lambda: EagleProposer(head, tree_nodes=-2), lambda: EagleProposer(head, tree_nodes=4, tree_width=0)):
        with pytest.raises(ValueError, match="tree"):
            make()


def test_batched_teacher_features_equal_one_sequence_at_a_time(tmp_path):
    """train-draft's features: several sequences per forward pass give each one's hidden states, exactly."""
    from services.draft_data import teacher_features
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.testing.tiny_llama import save_tiny
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4))
    seqs = [[3, 5, 7, 9, 11], [2, 4], [8, 1, 6, 6, 6, 6, 6, 1, 2]]
    batched = teacher_features(eng, seqs, tokens_per_pass=8)      # passes: [5 + 2], [9]
    eng.runner.capture_hidden()
    for ids, f in zip(seqs, batched):
        eng.score(ids)
        assert f.shape == (len(ids), eng.model_cfg.hidden_size)
        torch.testing.assert_close(f, eng.runner.last_hidden.float(), rtol=1e-5, atol=1e-5)
    assert eng.block_manager.num_used_blocks == 0


def test_features_cache_computes_only_new_sequences(tmp_path):
    """train-draft --features-cache: a rerun with more sequences reuses the stored hidden states of the old ones
    (the file is not read as a whole-or-nothing match) and computes the new ones, equal to a fresh computation."""
    from services.draft_data import cached_features, teacher_features
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.testing.tiny_llama import save_tiny
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4))
    path = str(tmp_path / "feats.pt")
    old, new = [[3, 5, 7, 9, 11], [2, 4]], [[8, 1, 6, 6, 6]]
    first = cached_features(eng, old, path)
    marked = [f + 1000.0 for f in first]                  # stored values tell reuse apart from recomputation
    torch.save({"seqs": old, "feats": marked}, path)
    calls = []
    hidden_states = eng.hidden_states
    eng.hidden_states = lambda seqs: calls.append(seqs) or hidden_states(seqs)
    both = cached_features(eng, old + new, path)
    assert calls == [new]
    for f, m in zip(both[:2], marked):
        torch.testing.assert_close(f, m)
    torch.testing.assert_close(both[2], teacher_features(eng, new)[0])
    saved = torch.load(path, weights_only=True)
    assert saved["seqs"] == old + new and len(saved["feats"]) == 3


def test_sampled_answers_are_seeded_cached_apart_from_greedy_and_reused(tmp_path):
    """train-draft --sampled-answers: round r at a temperature is reproducible (seeded per prompt and round),
    differs from the greedy answers, is cached under its own key, and a rerun reads it back without generating."""
    from services.draft_data import generate_answers
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.testing.tiny_llama import save_tiny
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4))
    prompts = [[3, 5, 7], [2, 4, 6, 8], [9, 1]]
    cache = str(tmp_path / "answers.jsonl")
    greedy = generate_answers(eng, prompts, 12, 2, cache)
    sampled = generate_answers(eng, prompts, 12, 2, cache, temperature=1.5, round_=1)
    other = generate_answers(eng, prompts, 12, 2, None, temperature=1.5, round_=2)
    assert all(len(a) == 12 for a in greedy + sampled)
    assert sampled != greedy and sampled != other
    assert generate_answers(eng, prompts, 12, 2, None, temperature=1.5, round_=1) == sampled    # seeded
    step = eng.step
    eng.step = lambda: pytest.fail("cached answers were generated again")
    assert generate_answers(eng, prompts, 12, 2, cache) == greedy
    assert generate_answers(eng, prompts, 12, 2, cache, temperature=1.5, round_=1) == sampled
    eng.step = step


def test_answer_only_loss_counts_answer_pairs_and_keeps_prompt_features_real():
    """train-draft --answer-loss-only: pair p of a sequence counts from the first pair the head drafts from in
    serving (last prompt position) up to its last pair; padding never counts; inputs up to that pair stay real."""
    from services.train_draft_cmd import pair_masks
    valid, real = pair_masks([5, 3], [2, 0], 6)
    assert valid.tolist() == [[False, False, True, True, True, False], [True, True, True, False, False, False]]
    assert real.tolist() == [[True, True, True, False, False, False], [True, False, False, False, False, False]]


def test_training_answers_pick_greedy_and_the_named_sampled_rounds(tmp_path):
    """train-draft --greedy-answers / --sampled-answers / --first-sample-round: the training text is the greedy
    answers (when asked) then sampled rounds first .. first + N - 1, paired with their prompts; no text is refused."""
    from services.draft_data import generate_answers, training_answers
    from services.train_draft_cmd import TrainDraftConfig
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.testing.tiny_llama import save_tiny
    save_tiny(tmp_path, None)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4))
    prompts = [[3, 5, 7], [2, 4, 6, 8]]
    kw = dict(max_tokens=6, gen_batch=2, sample_temperature=1.5)
    later = TrainDraftConfig(greedy_answers=False, sampled_answers=2, first_sample_round=2, **kw)
    seq_prompts, answers = training_answers(eng, prompts, later)
    assert seq_prompts == prompts * 2
    def sampled(r):
        return generate_answers(eng, prompts, 6, 2, None, 1.5, r)
    assert answers == sampled(2) + sampled(3)
    assert answers[:2] != sampled(1)
    both = training_answers(eng, prompts, TrainDraftConfig(sampled_answers=1, **kw))
    assert both == (prompts * 2, generate_answers(eng, prompts, 6, 2) + sampled(1))
    with pytest.raises(ValueError, match="no training text"):
        TrainDraftConfig(greedy_answers=False, sampled_answers=0)
    with pytest.raises(ValueError, match="first_sample_round"):
        TrainDraftConfig(first_sample_round=0)


def _ref_next_logp(head: EagleHead, feats: torch.Tensor, tokens: list[int], path: list[int]) -> torch.Tensor:
    """Reference without KV cache or tree masks: the head's log-distribution [N] of the token after the sequence's
    last token and then `path` (full-vocab ids), each step a dense causal pass over everything before it."""
    from shared.spec.eagle import causal_mask
    n = len(tokens) - 1
    f, t = feats[:n], list(tokens[1:])
    with torch.inference_mode():
        for j in range(len(path) + 1):
            m = len(t)
            out, _, _ = head(f[None], torch.tensor([t]), torch.arange(m)[None], None, causal_mask([0], [m], f.device))
            if j == len(path):
                return head.logits(out[0, -1]).log_softmax(-1)
            f, t = torch.cat([f, out[0, -1:]]), t + [path[j]]


@pytest.mark.parametrize("nodes,width,k", [(12, 3, 3), (24, 4, 4), (6, 2, 5), (2, 4, 3)])
def test_draft_tree_nodes_are_the_heads_top_candidates_along_their_paths(nodes, width, k):
    from shared.tree import check_tree, depths
    head = tiny_head(3)
    g = torch.Generator().manual_seed(4)
    seqs, feats = [], []
    for length in (12, 7):                               # two sequences of different lengths in one batch
        toks = torch.randint(0, V, (length,), generator=g).tolist()
        seqs.append(Sequence("r", 0, toks, SamplingParams(temperature=0, max_tokens=50)))
        feats.append(torch.randn(length, D, generator=g))
    prop = EagleProposer(head, tree_nodes=nodes, tree_width=width)
    for s, f in zip(seqs, feats):
        prop.accept_hidden(s, 0, f[:len(s) - 1])
    reduced = {int(t): j for j, t in enumerate(head.id_map)}
    per = nodes // 2                                     # the step's nodes are shared by the two sequences
    width, k = min(width, per), min(k, per)
    for s, f, (tokens, q, parents) in zip(seqs, feats, prop.propose(seqs, [k, k])):
        assert q is None and (parents is not None or per == 1)
        parents = parents or [-1]
        check_tree(parents, len(tokens))
        assert len(tokens) == min(per, width * k) and max(depths(parents)) <= k
        for i, (tok, par) in enumerate(zip(tokens, parents)):
            path = []
            while par >= 0:
                path.insert(0, tokens[par])
                par = parents[par]
            top = _ref_next_logp(head, f, s.token_ids, path).topk(width).indices.tolist()
            assert reduced[tok] in top                   # a child is among its parent's `width` best
        first = int(head.id_map[_ref_next_logp(head, f, s.token_ids, []).argmax()])
        assert first in [t for t, p in zip(tokens, parents) if p == -1]
        assert len(prop.states[s.seq_id].k) == len(s) - 1          # nothing of the tree stays in the head's KV


def test_a_packed_bf16_head_drafts_what_the_unpacked_one_drafts():
    """Serving packs a bf16 head's weights for oneDNN (EagleHead.pack): same drafts, chains and trees."""
    from shared.ops.packed_linear import PackedLinear, packing_available
    if not packing_available():
        pytest.skip("no oneDNN prepacked bf16 linear (torch build or CPU)")
    g = torch.Generator().manual_seed(5)
    greedy = SamplingParams(temperature=0, max_tokens=50)
    seqs = [Sequence("r", 0, torch.randint(0, V, (n,), generator=g).tolist(), greedy) for n in (6, 11)]
    feats = [torch.randn(len(s) - 1, D, generator=g).bfloat16() for s in seqs]
    drafts = []
    for pack in (False, True):
        head = tiny_head().to(torch.bfloat16)
        head.attach_target(head.embed.bfloat16(), head.final_norm.to(torch.bfloat16), torch.randn(V, D) * 3)
        if pack:
            head.pack()
            assert type(head.fc) is PackedLinear and head.packed_rows is not None
        out = []
        for nodes in (0, 6):
            prop = EagleProposer(head, tree_nodes=nodes, tree_width=3)
            for s, f in zip(seqs, feats):
                prop.accept_hidden(s, 0, f)
            out.append([tuple(p.tokens) + tuple(p.parents or ()) for p in prop.propose(seqs, [3, 4])])
        drafts.append(out)
    assert drafts[0] == drafts[1] and all(len(p) >= 3 for run in drafts[0] for p in run)


def test_an_int8_head_reads_int8_rows_close_to_the_bf16_ones():
    """Serving with int8_head: the LM head's rows as int8 blocks of 32 (BlockQuant.int8) through the quantised rows
    kernel: logits within the rounding of 8 bits of the bf16 head's, a zero block stays zero."""
    from shared.ops import qgemm
    from shared.ops.block_quant import BlockQuant
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    w[5, 32:64] = 0
    bq = BlockQuant.int8(w)
    assert bq.codes.dtype == torch.int8 and bq.scales[5, 1] == 0
    assert (bq.dequantise() - w).abs().max() <= w.abs().max() / 127 / 2 + 1e-6
    if not qgemm.available():
        pytest.skip("no quantised rows kernel on this CPU")
    head = tiny_head().to(torch.bfloat16)
    rows = torch.randn(V, D, generator=torch.Generator().manual_seed(4)) * 3
    head.attach_target(head.embed.bfloat16(), head.final_norm.to(torch.bfloat16), rows)
    head.pack(int8_head=True)
    assert head.int8_rows is None                 # N = 12 rows: a shape the kernel cannot take keeps bf16 rows
    head.id_map = torch.arange(32)                # 32 rows of the reduced vocab: the kernel's unit
    head.attach_target(head.embed.bfloat16(), head.final_norm.to(torch.bfloat16), rows)
    feats = torch.randn(5, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = head.logits(feats)
    head.pack(int8_head=True)
    got = head.logits(feats)
    assert head.int8_rows is not None and got.shape == ref.shape
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
