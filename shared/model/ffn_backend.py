"""Where a layer's feed-forward work runs: in this process, or on expert-shard services over RPC.

The model computes the router (gate) itself and hands the backend every (token, expert) slot of one layer at once,
so a remote backend sends one RPC per shard per layer per step. Dense models use the same seam: their FFN is split
by intermediate neurons across shards and the partial outputs are summed (attention-FFN disaggregation).

Shapes: T = tokens in the step, D = hidden, k = experts per token.
"""
from __future__ import annotations

from typing import Protocol

import torch


class ExpertBackend(Protocol):
    def moe(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
            ) -> torch.Tensor:
        """Routed experts of one MoE layer: hidden [T, D], topk_ids [T, k] int, topk_weights [T, k] ->
        sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])   [T, D]."""
        ...


class DenseBackend(Protocol):
    def dense(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The whole FFN of a dense layer: hidden [T, D] -> [T, D]."""
        ...
