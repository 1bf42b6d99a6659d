"""The "eagle:PATH" proposer: an EagleHead with per-sequence KV for its one layer, fed with the target's features.

The engine hands it the target's hidden states of accepted positions after every step (`accept_hidden`). Each
sequence keeps the head's KV of the positions it has processed with real target features (`real`); the K - 1
autoregressive draft steps append KV computed from predicted features, which is rolled back before the next
proposal (those positions are redone with real features once the target has computed them).
q is the head's distribution over the reduced vocab, shaped by the request's temperature / top-p / top-k and
scattered into the full vocab (zeros outside it), so rejection sampling stays exact. Greedy requests get point masses.
Shapes: B = sequences, T = new positions, D = hidden, N = reduced vocab, V = full vocab, KVH = kv heads, Dh = head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from shared.engine.config import check_draft_confidence, check_tree_shape
from shared.engine.proposal import NO_PROPOSAL, Proposal
from shared.engine.sampler import greedy_tokens, probs_from_logits
from shared.engine.sequence import Sequence
from shared.spec.eagle import EagleHead, causal_mask
from shared.spec.eagle_tree import draft_trees
from shared.spec.lookup import LOOKUP_N, LookupFirst
from shared.spec.proposers import prompt_lookup
from shared.tree import graft_chain


class HeadState:
    """One sequence's head KV: k / v [L, KVH, Dh] for positions origin .. origin + L - 1; the first `real` of them
    were computed from target features. `feats` [M, D] are target features of positions origin + real .. not yet run."""

    __slots__ = ("origin", "k", "v", "real", "feats", "generator")

    def __init__(self, origin: int, feats: torch.Tensor) -> None:
        self.origin, self.real, self.feats = origin, 0, feats
        self.k = self.v = None
        self.generator: torch.Generator | None = None

    @property
    def next_feature_pos(self) -> int:
        return self.origin + self.real + len(self.feats)

    def rollback(self, length: int) -> None:
        """Keeps the first `length` KV rows (positions origin .. origin + length - 1)."""
        if self.k is not None:
            self.k, self.v = self.k[:length], self.v[:length]


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    """How a served EAGLE head drafts, unless the service's flags say otherwise (--draft-confidence,
    --draft-tree-nodes, --draft-tree-ngram). Serving settings, not part of a head: the values are the ones measured
    best for the default model's head (docs/eagle-head.md)."""
    confidence: float = 0.15        # stop a draft once the head's probability of its path falls below this
    tree_nodes: int = 5             # tree nodes per step, shared by the step's greedy sequences (0: chains);
    # with the root, 6 rows to verify: one pass of the bf16 rows kernel's 6-row tiles over the weights
    tree_width: int = 8             # candidates kept per depth of a tree
    tree_ngram: int = 4             # graft prompt lookup's continuation of up to this many tokens onto each tree
    depth: int = 4                  # the head drafts at most this many tokens deep (K beyond it: lookup chains)
    int8_head: bool = True          # the LM head's rows as int8 blocks (EagleHead.pack): half a pass's biggest read
    lookup_n: int = LOOKUP_N        # a sequence whose last lookup_n tokens occurred before is drafted by prompt
    # lookup alone, a chain (up to the sequence's lookup_k), without the head's passes (0: off; shared.spec.lookup)


SERVING = DraftPolicy()


class EagleProposer:
    wants_hidden = True

    def __init__(self, head: EagleHead, min_confidence: float = 0.0, tree_nodes: int = 0, tree_width: int = 4,
                 tree_ngram: int = 0, depth: int | None = None, lookup_n: int = 0) -> None:
        check_draft_confidence(min_confidence)
        check_tree_shape(tree_nodes, tree_width)
        if tree_ngram < 0:
            raise ValueError(f"tree_ngram must be >= 0 (0 = off), got {tree_ngram}")
        self.head = head
        self.min_confidence = min_confidence          # 0 = always draft the K tokens asked for
        self.tree_nodes, self.tree_width = tree_nodes, tree_width    # greedy sequences get trees (0 = chains):
        # tree_nodes per step, split among the greedy sequences of the batch
        self.tree_ngram = tree_ngram                  # prompt lookup's continuation grafted onto each tree (0 = off)
        self.depth = depth                            # the head's drafts at most this deep (None: K)
        self.lookup = LookupFirst(lookup_n)           # text that repeats: lookup chains instead of the head
        self.states: dict[int, HeadState] = {}

    # ---------------------------------------------------------------- features in
    def accept_hidden(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """hidden [M, D]: the target's features at positions start .. start + M - 1 (all with accepted inputs)."""
        hidden = self.head.features(hidden.to(self.head.dtype))                     # [M, D]
        st = self.states.get(seq.seq_id)
        if st is None or start < st.origin or start > st.next_feature_pos:
            self.states[seq.seq_id] = HeadState(start, hidden)      # new, or a gap: begin again from here
            return
        done = st.origin + st.real
        if start < done:                                            # recomputed positions (preemption): roll back
            st.real = start - st.origin
            st.rollback(st.real)
            st.feats = hidden
        else:
            st.feats = torch.cat([st.feats[:start - done], hidden])

    # ---------------------------------------------------------------- proposals out
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out: list[Proposal] = [NO_PROPOSAL] * len(seqs)
        # Text that repeats its context is drafted by lookup alone; the head's features of those positions wait
        # in their HeadState and go through the head in one pass when it drafts for the sequence again.
        chains = self.lookup.chains(seqs, ks)
        for i, chain in chains.items():
            out[i] = Proposal(chain)
        if self.depth is not None:
            ks = [min(k, self.depth) for k in ks]
        # A sequence can be drafted for when the head has features up to its second-to-last token.
        live = [i for i, s in enumerate(seqs) if (st := self.states.get(s.seq_id)) is not None and len(st.feats)
                and st.next_feature_pos == len(s) - 1 and ks[i] > 0 and i not in chains]
        if not live:
            return out
        states = [self.states[seqs[i].seq_id] for i in live]
        for st in states:
            st.rollback(st.real)                                     # forget the last drafts' KV
        # 1) the new real features: pair (f_p, x_{p+1}) at p = origin + real ...
        feats = [st.feats for st in states]
        starts = [st.origin + st.real for st in states]
        toks = [torch.tensor(seqs[i].token_ids[p + 1:p + 1 + len(f)]) for i, p, f in zip(live, starts, feats)]
        pos = [torch.arange(p, p + len(f)) for p, f in zip(starts, feats)]
        last = self._run(states, feats, toks, pos)                  # [B, D] predicted feature of each last pair
        for st, f in zip(states, feats):
            st.real += len(f)
            st.feats = f[:0]
        # 2) greedy sequences: draft trees of up to K depths (shared.spec.eagle_tree) sharing tree_nodes nodes
        # per step, since the target verifies every node of the batch in one pass: a sequence alone gets them all,
        # a batch of 8 one each (its head's first choice).
        trees = [r for r, i in enumerate(live) if self.tree_nodes and seqs[i].drafts_trees()]
        in_tree = set(trees)
        if trees:
            nodes = max(1, self.tree_nodes // len(trees))
            for r, prop in zip(trees, draft_trees(self.head, [states[r] for r in trees], last[trees],
                                                  [min(ks[live[r]], nodes) for r in trees],
                                                  min(self.tree_width, nodes), nodes)):
                # the graft adds at most half the node budget
                out[live[r]] = self._graft(seqs[live[r]], prop, min(ks[live[r]], self.tree_ngram), nodes // 2)
        # 3) the others: chains
        rows = [r for r in range(len(live)) if r not in in_tree]
        if rows:
            for r, prop in zip(rows, self._draft_chains([seqs[live[r]] for r in rows], [ks[live[r]] for r in rows],
                                                        [states[r] for r in rows], last[rows])):
                out[live[r]] = prop
        return out

    def _draft_chains(self, seqs: list[Sequence], ks: list[int], states: list[HeadState], last: torch.Tensor
                      ) -> list[Proposal]:
        """Up to K draft steps per sequence (last [B, D]: each one's predicted feature); step j > 0 feeds back the
        predicted feature and drafted token. A row stops early once the head's own probability of its draft path
        (the product of its tokens' probabilities) would fall below min_confidence: the head is well calibrated, so
        unlikely drafts are not worth their step."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        path = [1.0] * len(seqs)
        rows = list(range(len(seqs)))                                # rows still drafting
        for step in range(max(ks)):
            logits = self.head.logits(last)                          # [R, N]
            drafted = self._choose(logits, [seqs[b] for b in rows], [states[b] for b in rows])
            if self.min_confidence:
                conf = logits.softmax(-1)[torch.arange(len(rows)), torch.tensor([j for _, _, j in drafted])].tolist()
            go = []
            for r, (b, (tok, q, _)) in enumerate(zip(rows, drafted)):
                if self.min_confidence:
                    path[b] *= conf[r]
                if step and path[b] < self.min_confidence:
                    continue                                         # stop this row before this draft
                tokens[b].append(tok)
                if q is not None:
                    probs[b].append(q)
                if step + 1 < ks[b]:
                    go.append(r)
            if not go:
                break
            rows = [rows[r] for r in go]
            nxt = [torch.tensor([drafted[r][0]]) for r in go]                 # [1] each
            sub = [states[b] for b in rows]
            npos = [torch.tensor([st.origin + len(st.k)]) for st in sub]
            last = self._run(sub, [last[r][None] for r in go], nxt, npos)
        return [Proposal(t, torch.stack(q) if q else None) for t, q in zip(tokens, probs)]

    @staticmethod
    def _graft(seq: Sequence, prop: Proposal, length: int, max_new: int) -> Proposal:
        """The tree with prompt lookup's continuation (the tokens that followed the latest earlier occurrence of the
        sequence's last 3, else 2 tokens; up to `length`) as one more branch, adding at most max_new nodes: text
        that repeats its context (lists, code, quotes) is drafted where the head is unsure."""
        if length < 1 or max_new < 1:
            return prop
        chain = prompt_lookup(seq.token_ids, length, max_n=3, min_n=2)
        if not chain:
            return prop
        tokens, parents = graft_chain(prop.tokens, prop.parents, chain, max_new)
        return Proposal(tokens, None, parents)

    def _run(self, states: list[HeadState], feats: list[torch.Tensor], toks: list[torch.Tensor],
             pos: list[torch.Tensor]) -> torch.Tensor:
        """One padded batched pass of the head; appends the new KV to each state -> last predicted feature [B, D]."""
        dev = self.head.device
        new_lens = [len(f) for f in feats]
        past_lens = [0 if st.k is None else len(st.k) for st in states]
        f = pad_sequence(feats, batch_first=True).to(dev)                                   # [B, T, D]
        t = pad_sequence(toks, batch_first=True).to(dev)                                    # [B, T]
        p = pad_sequence(pos, batch_first=True).to(dev)
        past = None
        if max(past_lens):
            empty = self._empty_kv()
            past = (pad_sequence([st.k if st.k is not None else empty for st in states], batch_first=True),
                    pad_sequence([st.v if st.v is not None else empty for st in states], batch_first=True))
        mask = causal_mask(past_lens, new_lens, dev)
        out, k, v = self.head(f, t, p, past, mask)                                          # [B, T, D]
        for b, (st, n) in enumerate(zip(states, new_lens)):
            st.k = k[b, :n] if st.k is None else torch.cat([st.k, k[b, :n]])
            st.v = v[b, :n] if st.v is None else torch.cat([st.v, v[b, :n]])
        return out[torch.arange(len(states)), torch.tensor(new_lens) - 1]                 # [B, D]

    def _empty_kv(self) -> torch.Tensor:
        c = self.head.cfg
        return torch.zeros(0, c.num_kv_heads, c.head_dim, dtype=self.head.dtype, device=self.head.device)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], states: list[HeadState]
                ) -> list[tuple[int, torch.Tensor | None, int]]:
        """logits [B, N] -> per row (full-vocab token, q [V] or None for a greedy point mass, reduced-vocab index)."""
        id_map = self.head.id_map
        best = greedy_tokens(logits)
        greedy, best = id_map[best].tolist(), best.tolist()
        out: list[tuple[int, torch.Tensor | None, int]] = []
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
        qs = None
        if sampled:
            ps = [seqs[b].params for b in sampled]
            qs = probs_from_logits(logits[sampled], torch.tensor([p.temperature for p in ps]),
                                   torch.tensor([p.top_k for p in ps]), torch.tensor([p.top_p for p in ps]))
        row = {b: j for j, b in enumerate(sampled)}
        for b, s in enumerate(seqs):
            if b not in row:
                out.append((greedy[b], None, best[b]))
                continue
            st = states[b]
            if st.generator is None:
                st.generator = torch.Generator()
                st.generator.manual_seed((s.params.seed if s.params.seed is not None else s.seq_id) * 7919 + 17)
            q_red = qs[row[b]]                                                           # [N]
            j = int(torch.multinomial(q_red, 1, generator=st.generator))
            q = q_red.new_zeros(self.head.cfg.vocab_size).index_copy_(0, id_map, q_red)   # [V]
            out.append((int(id_map[j]), q, j))
        return out

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        self.lookup.release(seq_id)


def make_eagle(path: str, dtype: torch.dtype, device: torch.device, target: torch.nn.Module | None,
               target_path: str | None, min_confidence: float | None = None, tree_nodes: int | None = None,
               tree_ngram: int | None = None, lookup_n: int | None = None) -> EagleProposer:
    """The head at `path`, with the embedding, final norm and LM head of `target` (in-process) or of the checkpoint
    at `target_path` (a draft service; None = the default model); drafts stop below `min_confidence`, greedy
    sequences get trees of up to `tree_nodes` (0 = chains) with prompt lookup's continuation of up to `tree_ngram`
    tokens grafted on (None: the SERVING policy's value)."""
    from shared.spec.eagle import load_target_parts

    head = EagleHead.load(path, dtype, device)
    if target is not None:
        head.attach_target(target.embed_tokens.weight, target.norm, target.lm_head.weight)
    else:
        head.attach_target(*load_target_parts(target_path, dtype, device))
    head.pack(int8_head=SERVING.int8_head)        # bf16 on CPU: prepacked weights, the LM head's rows in int8
    if head.embed.shape[0] != head.cfg.vocab_size:
        raise ValueError(f"eagle head {path} was trained for a vocab of {head.cfg.vocab_size}, the target has "
                         f"{head.embed.shape[0]}")
    return EagleProposer(head, SERVING.confidence if min_confidence is None else min_confidence,
                         SERVING.tree_nodes if tree_nodes is None else tree_nodes, SERVING.tree_width,
                         SERVING.tree_ngram if tree_ngram is None else tree_ngram, SERVING.depth,
                         SERVING.lookup_n if lookup_n is None else lookup_n)
