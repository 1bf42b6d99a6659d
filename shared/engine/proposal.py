"""What a speculative proposer gives the engine, and the interface the engine calls. Proposers themselves live in
shared.spec; the engine receives one through a factory (LLMEngine(cfg, make_proposer=...)) or as an object the
target's Verify relay sets. Shapes: K = draft tokens, V = vocab."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from shared.engine.config import EngineConfig
from shared.engine.sequence import Sequence


class Proposal(NamedTuple):
    """K draft tokens for one sequence. A chain unless `parents` is given: then a draft tree (shared.tree),
    parents[i] = the index of token i's parent, -1 for the sequence's last real token; trees are greedy-only."""
    tokens: list[int]
    probs: torch.Tensor | None = None          # q [K, V], None for point masses
    parents: list[int] | None = None


NO_PROPOSAL = Proposal([])


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]: ...
    def release(self, seq_id: int) -> None: ...
    # Optional: a proposer with `wants_hidden = True` also gets, after every step, the target's last hidden states
    # (before the final norm) [M, D] of the positions start .. start + M - 1 whose inputs were accepted:
    #     def accept_hidden(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None


# (engine config, the target model, the engine's max model length) -> the engine's in-process proposer
ProposerFactory = Callable[[EngineConfig, torch.nn.Module, int], Proposer]
