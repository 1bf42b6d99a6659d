"""The model's side of expert parallelism: each dense layer's MLP and each MoE block's backend replaced by stand-ins
that send their work to the expert shards through an ExpertsClient (shared.shards.client), and the local FFN weights
freed.

`attach_expert_shards` swaps each dense layer's MLP for a `RemoteMLP` (calling `RemoteDense`) and each MoE block's
backend for `RemoteExperts`. Shapes: T = tokens in the step, D = hidden, k = units per token.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shared.ops.packed_linear import PackedLinear
from shared.shards.client import ExpertsClient


class RemoteDense:
    """DenseBackend over the shards: each shard computes its slice of the layer's FFN; the slices sum to it."""

    def __init__(self, client: ExpertsClient) -> None:
        self.client = client
        self.slices = torch.arange(client.placement.num_shards)

    def dense(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.slices.expand(hidden.shape[0], -1)                          # [T, N]: every token, every slice
        return self.client.run(layer, hidden, ids, None)


class RemoteExperts(nn.Module):
    """ExpertBackend over the shards (a Module so it can take the place of a module-valued backend)."""

    def __init__(self, client: ExpertsClient) -> None:
        super().__init__()
        self.client = client

    def moe(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
            ) -> torch.Tensor:
        return self.client.run(layer, hidden, topk_ids, topk_weights)


class RemoteMLP(nn.Module):
    """Stands in for a dense layer's MLP; its weights live on the expert shards."""

    def __init__(self, layer: int, backend: RemoteDense) -> None:
        super().__init__()
        self.layer, self.backend = layer, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.dense(self.layer, x)                               # [T, D]


def ffn_kinds(model: nn.Module) -> list[bool]:
    """Per decoder layer: True = a dense SwiGLU MLP, False = an MoE block (it has a `backend`)."""
    kinds = []
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        if hasattr(mlp, "backend"):
            kinds.append(False)
        elif hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
            kinds.append(True)
        else:
            raise ValueError(f"layer {i}: {type(mlp).__name__} is neither a dense MLP nor an MoE block; "
                             "its FFN cannot run on expert shards")
    return kinds


def attach_expert_shards(model: nn.Module, client: ExpertsClient) -> int:
    """Routes every layer's FFN through `client` and frees the local FFN weights; returns the bytes freed."""
    dense = RemoteDense(client)
    experts = RemoteExperts(client)
    freed = 0
    for i, (layer, is_dense) in enumerate(zip(model.layers, ffn_kinds(model))):
        if is_dense:
            old, layer.mlp = layer.mlp, RemoteMLP(i, dense)
            freed += _free(old, keep=())
        else:
            old, layer.mlp.backend = layer.mlp.backend, experts
            freed += _free(old, keep=(layer, layer.mlp))
    return freed


def _tensors(obj, keep: tuple) -> Iterator[torch.Tensor | PackedLinear]:
    """The weights an FFN module or backend holds (not those of `keep`, the modules it sits in)."""
    if isinstance(obj, nn.Module):
        if not any(obj is k for k in keep):
            yield from obj.parameters()
            yield from obj.buffers()
            yield from (m for m in obj.modules() if isinstance(m, PackedLinear))    # packed copies: not buffers
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, keep)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
        for name in names:
            v = getattr(obj, name, None)
            if isinstance(v, (nn.Module, torch.Tensor, list, tuple)):
                yield from _tensors(v, keep)


def _free(obj, keep: tuple) -> int:
    seen, freed = set(), 0
    for t in _tensors(obj, keep):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, PackedLinear):
            freed += t.release()
            continue
        if t.numel() == 0:
            continue
        freed += t.numel() * t.element_size()
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return freed
