"""Draft trees from an EAGLE head (EAGLE-2 style): several candidates per depth, verified in one target pass.

For greedy sequences the head does not commit to its top-1 token at every depth. From the root (the sequence's
last real token, whose predicted feature `last` the head has just computed) it expands the W most likely
children; at every further depth it runs the head once over the W frontier nodes of each sequence, scores each
node's W best children by path log-probability (the sum of log q along the path) and keeps the W best of those
W * W as the next frontier. K depths give K * W candidates; the N with the highest path probability (each node
scores no higher than its parent, so the set contains its ancestors) become the proposal, in depth order with
parent indices (shared.engine.tree). So a confident head drafts a long narrow tree and an unsure one a short bushy
tree, of the same size: the target verifies N + 1 rows at about the cost of one while N is small (on CPU, bf16 rows
are nearly free up to about 10: bench/bench_matmul_rows.py).

The head's KV of the tree nodes lives only during one call: a node attends to the sequence's real KV, its
ancestors' KV and its own (an ancestor mask), and nothing of it is kept.
Shapes: B = sequences, W = tree width, M = tree nodes processed so far, P = real cached positions, D = hidden,
N = reduced vocab, KVH = kv heads, Dh = head dim.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from shared.engine.eagle import EagleHead
from shared.engine.proposers import Proposal


def draft_trees(head: EagleHead, states: list, last: torch.Tensor, ks: list[int], width: int, max_nodes: int
                ) -> list[Proposal]:
    """states: the sequences' HeadStates (real KV only), last [B, D]: each root's predicted feature, ks: each
    sequence's depth -> one tree Proposal per sequence."""
    dev = last.device
    b = len(states)
    depth = max(ks)
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
    pool: list[list[tuple[float, int, int, int]]] = [[] for _ in range(b)]
    frontier = [[len(pool[i]) + j for j in range(width)] for i in range(b)]    # pool indices of the frontier
    for i, (sc, ix) in enumerate(zip(score.tolist(), idx.tolist())):
        pool[i] += [(s, 1, t, -1) for s, t in zip(sc, ix)]
    slot_of: list[dict[int, int]] = [{} for _ in range(b)]                       # pool index -> processed KV slot
    tree_k = tree_v = None                                                       # [B, M, KVH, Dh]
    feats = last[:, None].expand(b, width, last.shape[-1])                       # [B, W, D]: each node's parent feature
    origin = torch.tensor([st.origin + n for st, n in zip(states, real_lens)], device=dev)   # first draft position
    for d in range(1, depth):
        m = 0 if tree_k is None else tree_k.shape[1]
        toks = head.id_map[torch.tensor([[pool[i][j][2] for j in frontier[i]] for i in range(b)], device=dev)]
        pos = (origin + d - 1)[:, None].expand(b, width)                        # [B, W]
        mask = torch.zeros(b, width, p + m + width, dtype=torch.bool, device=dev)
        mask[:, :, :p] = torch.arange(p, device=dev)[None, None, :] < torch.tensor(real_lens, device=dev)[:, None, None]
        for i in range(b):
            for r, j in enumerate(frontier[i]):
                slot_of[i][j] = m + r
                a = j
                while a >= 0:                                                    # itself and its ancestors
                    mask[i, r, p + slot_of[i][a]] = True
                    a = pool[i][a][3]
        past = (torch.cat([real_k] + ([tree_k] if tree_k is not None else []), 1),
                torch.cat([real_v] + ([tree_v] if tree_v is not None else []), 1))
        out, k, v = head(feats, toks, pos, past, mask)                           # [B, W, D]
        tree_k = k if tree_k is None else torch.cat([tree_k, k], 1)
        tree_v = v if tree_v is None else torch.cat([tree_v, v], 1)
        logp = head.logits(out).log_softmax(-1)                                  # [B, W, N]
        child_score, child_idx = logp.topk(width, dim=-1)                        # [B, W, W]
        parent_score = torch.tensor([[pool[i][j][0] for j in frontier[i]] for i in range(b)], device=dev)
        total = (parent_score[:, :, None] + child_score).view(b, -1)             # [B, W * W]
        best_score, best = total.topk(width, dim=-1)                             # [B, W]
        rows = (best // width).tolist()
        tokens = child_idx.view(b, -1).gather(1, best).tolist()
        new_frontier = []
        for i in range(b):
            start = len(pool[i])
            pool[i] += [(s, d + 1, t, frontier[i][r]) for s, t, r in zip(best_score[i].tolist(), tokens[i], rows[i])]
            new_frontier.append(list(range(start, start + width)))
        feats = out.gather(1, (best // width)[:, :, None].expand(b, width, out.shape[-1]))   # [B, W, D]
        frontier = new_frontier
    id_map = head.id_map.tolist()
    return [_select(pool[i], ks[i], max_nodes, id_map) for i in range(b)]


def _select(pool: list[tuple[float, int, int, int]], depth: int, max_nodes: int, id_map: list[int]) -> Proposal:
    """The best `max_nodes` candidates up to `depth` by path probability, in depth order, as tokens of the full
    vocab and parent indices among themselves."""
    order = sorted((j for j, (_, d, _, _) in enumerate(pool) if d <= depth), key=lambda j: (-pool[j][0], pool[j][1]))
    keep = order[:max_nodes]
    keep.sort(key=lambda j: (pool[j][1], j))                                     # parents before children
    index = {j: n for n, j in enumerate(keep)}
    return Proposal([id_map[pool[j][2]] for j in keep], None, [index[pool[j][3]] if pool[j][3] >= 0 else -1
                                                               for j in keep])
