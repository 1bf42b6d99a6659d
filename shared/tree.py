"""Draft trees: several candidate continuations verified by the target in one forward pass.

A tree proposal is N draft tokens with a parent index each (-1 = the sequence's last real token, the root);
parents come before their children, so node i's ancestors all have smaller indices. A chain is the tree whose
parents are -1, 0, 1, ...

    root (last real token, position c)         node   parent  depth  position   KV slot (token index)
     ├── a  ── c ── e                            a      -1      1      c + 1      c + 1
     └── b  ── d                                 b      -1      1      c + 1      c + 2
                                                 c       0      2      c + 2      c + 3
                                                 d       1      2      c + 2      c + 4
                                                 e       2      3      c + 3      c + 5

The target runs the root and the N nodes as one verification: node i is at position c + depth(i) (RoPE) but its
KV is written to token index c + 1 + i, and it attends to the cached context, the root and its own ancestors
(`ancestor_mask`). Greedy verification walks down from the root while a child carries the target's argmax
(`walk_greedy`); the accepted path's KV then moves to token indices c + 1 .. c + n (`compaction`), after which the
sequence is exactly what a chain of those n tokens would have left. Trees are for greedy requests: sampled requests
verify chains with exact rejection sampling (shared.engine.rejection).
Shapes: N = tree nodes, V = vocab.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_TREE_NODES = 64      # the most nodes of one sequence's tree (a target drops larger ones from a draft service)


def check_tree(parents: list[int], num_tokens: int) -> None:
    """Raises ValueError unless `parents` is a valid tree over num_tokens nodes (each parent before its child)."""
    if len(parents) != num_tokens:
        raise ValueError(f"a tree needs one parent per token: {len(parents)} parents for {num_tokens} tokens")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}; a parent must be -1 (the root) or an earlier node")


def is_chain(parents: list[int] | None) -> bool:
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    """Depth of every node: 1 for the root's children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[N + 1, N + 1] bool over (root, nodes): row j may attend to column i iff i is j, or an ancestor of j, or the
    root. Row 0 is the root itself (it attends only to itself among the new tokens)."""
    import torch                           # here: the launcher checks tree settings without loading torch

    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]                         # the parent's ancestors (the root's row for p = -1)
        mask[i + 1, i + 1] = True
    return mask.to(device) if device is not None else mask


def walk_greedy(target_logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """target_logits [N + 1, V] (row 0: the root, row 1 + i: node i) -> (accepted nodes from the root down, the
    token emitted after them: the target's argmax where the walk stops)."""
    best = target_logits.max(dim=-1).indices.tolist()     # argmax's indices (shared.engine.sampler.greedy_tokens)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in children.get(node, []) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def graft_chain(tokens: list[int], parents: list[int], chain: list[int], max_new: int
                ) -> tuple[list[int], list[int]]:
    """Adds `chain`, a candidate continuation from the root (e.g. prompt lookup's), to a tree as one more branch:
    it follows the nodes that already carry its tokens and appends at most `max_new` of the rest as new nodes, each
    the child of the one before -> (tokens, parents). Verification then accepts the longer of the two."""
    tokens, parents = list(tokens), list(parents)
    node, i = -1, 0
    while i < len(chain):                                    # follow the nodes that already carry the chain
        nxt = next((c for c, p in enumerate(parents) if p == node and tokens[c] == chain[i]), None)
        if nxt is None:
            break
        node, i = nxt, i + 1
    for t in chain[i:i + max_new]:                           # then append the rest, each under the one before
        tokens.append(t)
        parents.append(node)
        node = len(tokens) - 1
    return tokens, parents


def compaction(path: list[int]) -> list[tuple[int, int]]:
    """(from, to) offsets past the root of the accepted nodes' KV: node path[j] sits at 1 + path[j] and belongs at
    1 + j. Moves in this order never overwrite a source still to be read (path[j] >= j, increasing)."""
    return [(1 + a, 1 + j) for j, a in enumerate(path) if a != j]
