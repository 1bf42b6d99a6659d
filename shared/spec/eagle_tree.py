"""Draft trees from an EAGLE head (EAGLE-2 style): several candidates per depth, verified in one target pass.

For greedy sequences the head does not commit to its top-1 token at every depth. From the root (the sequence's
last real token, whose predicted feature `last` the head has just computed) it expands the W most likely
children; at every further depth it runs the head once over the frontier nodes of each sequence, scores each
node's W best children by path log-probability (the sum of log q along the path) and keeps the W best of those as
the next frontier. K depths give up to K * W candidates; the N with the highest path probability (each node scores
no higher than its parent, so the set contains its ancestors) become the proposal, in depth order with parent
indices (shared.tree). A frontier node that already scores below the N-th best candidate cannot have a
selected descendant, so it is not expanded: the passes shrink, and stop early when the head is unsure. So a
confident head drafts a long narrow tree and an unsure one a short bushy tree, of the same size: the target
verifies N + 1 rows at about the cost of one while N is small (on CPU, bf16 rows are nearly free up to about 10:
bench/bench_matmul_rows.py).

The head's KV of the tree nodes lives only during one call: a node attends to the sequence's real KV, its
ancestors' KV and its own (an ancestor mask), and nothing of it is kept.
Shapes: B = sequences, W = tree width, M = tree nodes processed so far, P = real cached positions, D = hidden,
N = reduced vocab, KVH = kv heads, Dh = head dim.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from shared.engine.proposal import Proposal
from shared.spec.eagle import EagleHead


def draft_trees(head: EagleHead, states: list, last: torch.Tensor, ks: list[int], width: int, max_nodes: int
                ) -> list[Proposal]:
    """states: the sequences' HeadStates (real KV only), last [B, D]: each root's predicted feature, ks: each
    sequence's depth -> one tree Proposal per sequence, of its best nodes (at most max_nodes)."""
    dev = last.device
    b = len(states)
    c = head.cfg
    real_lens = [0 if st.k is None else len(st.k) for st in states]
    empty = last.new_zeros(0, c.num_kv_heads, c.head_dim)
    real_k = pad_sequence([st.k if st.k is not None else empty for st in states], batch_first=True)   # [B, P, ..]
    real_v = pad_sequence([st.v if st.v is not None else empty for st in states], batch_first=True)
    p = real_k.shape[1]
    # Depth 1: the root's W best children.
    logp = head.logits(last).log_softmax(-1)                                     # [B, N]
    score, idx = logp.topk(width, dim=-1)                                        # [B, W]
    # Every candidate of every depth, per sequence: (score, depth, token index in the reduced vocab, parent).
    pool: list[list[tuple[float, int, int, int]]] = [[(s, 1, t, -1) for s, t in zip(sc, ix)]
                                                     for sc, ix in zip(score.tolist(), idx.tolist())]
    frontier = [_worth_expanding(pool[i], list(range(width)), max_nodes) if ks[i] > 1 else [] for i in range(b)]
    slot_of: list[dict[int, int]] = [{-1: -1} for _ in range(b)]    # pool index -> its slot in tree_k / tree_v
    node_feat = last[:, None]                                        # [B, 1 + M, D]: the root's, then slot m's at 1 + m
    tree_k = tree_v = None                                           # [B, M, KVH, Dh]
    origin = [st.origin + n for st, n in zip(states, real_lens)]     # the position of a depth-1 node
    real_mask = torch.arange(p, device=dev)[None, :] < torch.tensor(real_lens, device=dev)[:, None]   # [B, P]
    d = 1
    while any(frontier):
        f = max(len(fr) for fr in frontier)                          # rows this pass; shorter frontiers are padded
        m = 0 if tree_k is None else tree_k.shape[1]
        # shorter frontiers are padded with node 0 (a child of the root: a valid input whose output is unused)
        rows = [fr + [0] * (f - len(fr)) for fr in frontier]
        toks = head.id_map[torch.tensor([[pool[i][j][2] for j in r] for i, r in enumerate(rows)], device=dev)]  # [B, F]
        # each row reads its parent's predicted feature (slot -1 + 1 = 0: the root's)
        parent_slot = torch.tensor([[1 + slot_of[i][pool[i][j][3]] for j in r] for i, r in enumerate(rows)],
                                   device=dev)                                                         # [B, F]
        feats = node_feat[torch.arange(b, device=dev)[:, None], parent_slot]                          # [B, F, D]
        pos = torch.tensor([[o + d - 1] * f for o in origin], device=dev)                             # [B, F]
        tree_mask = _tree_mask(pool, frontier, slot_of, m, f)                                        # [B, F, M + F]
        mask = torch.cat([real_mask[:, None, :].expand(b, f, p), torch.tensor(tree_mask, device=dev)], -1)
        past = (torch.cat([real_k] + ([tree_k] if tree_k is not None else []), 1),
                torch.cat([real_v] + ([tree_v] if tree_v is not None else []), 1))
        out, k, v = head(feats, toks, pos, past, mask)                                                # [B, F, D]
        tree_k = k if tree_k is None else torch.cat([tree_k, k], 1)
        tree_v = v if tree_v is None else torch.cat([tree_v, v], 1)
        node_feat = torch.cat([node_feat, out], 1)
        child_score, child_idx = head.logits(out).log_softmax(-1).topk(width, dim=-1)                 # [B, F, W]
        child_score, child_idx = child_score.tolist(), child_idx.tolist()
        d += 1
        for i in range(b):
            new = _add_children(pool[i], frontier[i], child_score[i], child_idx[i], width, d)
            frontier[i] = _worth_expanding(pool[i], new, max_nodes) if d < ks[i] else []
    ranked = [_ranked(pool[i], ks[i], max_nodes) for i in range(b)]
    return [_select(pool[i], r, head.id_map) for i, r in enumerate(ranked)]


def _tree_mask(pool: list, frontier: list[list[int]], slot_of: list[dict[int, int]], m: int, f: int
               ) -> list[list[list[bool]]]:
    """The tree part of a pass's mask, built on the host, [B][F][M + F]: a row attends to its ancestors' slots and
    to itself (a padding row: only itself). Records each frontier node's slot (m + its row) in slot_of."""
    tree_mask = [[[False] * (m + f) for _ in range(f)] for _ in frontier]
    for i, fr in enumerate(frontier):
        for r in range(f):
            row = tree_mask[i][r]
            row[m + r] = True
            if r < len(fr):
                slot_of[i][fr[r]] = m + r
                a = pool[i][fr[r]][3]
                while a >= 0:                                        # its ancestors
                    row[slot_of[i][a]] = True
                    a = pool[i][a][3]
    return tree_mask


def _add_children(pool: list[tuple[float, int, int, int]], frontier: list[int], child_score: list, child_idx: list,
                  width: int, d: int) -> list[int]:
    """Adds the W best children (at depth d) of the frontier's nodes to the pool -> their pool indices."""
    cands = [(pool[j][0] + cs, t, j) for r, j in enumerate(frontier) for cs, t in zip(child_score[r], child_idx[r])]
    cands.sort(key=lambda x: -x[0])
    first = len(pool)
    pool += [(sc, d, t, j) for sc, t, j in cands[:width]]
    return list(range(first, len(pool)))


def _worth_expanding(pool: list[tuple[float, int, int, int]], nodes: list[int], max_nodes: int) -> list[int]:
    """The nodes whose children could still be among the best max_nodes: a child scores at most its parent, so a
    node below the max_nodes-th best score of the pool can have no selected descendant (the selection is what it
    would be without this pruning; the passes get fewer rows, and stop once no node qualifies)."""
    if len(pool) < max_nodes:
        return nodes
    floor = sorted((x[0] for x in pool), reverse=True)[max_nodes - 1]
    return [j for j in nodes if pool[j][0] >= floor and pool[j][0] > float("-inf")]


def _ranked(pool: list[tuple[float, int, int, int]], depth: int, max_nodes: int) -> list[int]:
    """The best `max_nodes` candidates up to `depth` by path probability, best first (a parent before its
    children: it scores at least as high, and ties go to the shallower)."""
    order = sorted((j for j, (_, d, _, _) in enumerate(pool) if d <= depth), key=lambda j: (-pool[j][0], pool[j][1]))
    return order[:max_nodes]


def _select(pool: list[tuple[float, int, int, int]], keep: list[int], id_map: torch.Tensor) -> Proposal:
    """Candidates `keep` (closed under ancestors) in depth order, as tokens of the full vocab and parent indices
    among themselves."""
    keep = sorted(keep, key=lambda j: (pool[j][1], j))                           # parents before children
    index = {j: n for n, j in enumerate(keep)}
    tokens = id_map[torch.tensor([pool[j][2] for j in keep], device=id_map.device)].tolist() if keep else []
    return Proposal(tokens, None, [index[pool[j][3]] if pool[j][3] >= 0 else -1 for j in keep])
