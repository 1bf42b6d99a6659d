"""Placement of FFN units on expert shards, and the pure halves of dispatch and combine.

A *unit* is what a shard computes for one slot: a routed expert of an MoE layer, or one slice of a dense layer's FFN
split by intermediate neurons (slice s of N holds rows [s*I/N, (s+1)*I/N) of gate and up and the matching columns of
down; the slices' outputs sum to the whole FFN). A dense model is thus an MoE with N units per layer, every token routed
to all of them with weight 1 (attention-FFN disaggregation).

Placement maps (layer, unit) -> the shards holding it. Contiguous by default (unit u of U on shard u*N//U); a JSON
file can override whole layers, e.g. to replicate hot experts (EPLB-style). Placement never changes outputs: every
replica holds the same weights.

    {"num_shards": 2, "num_experts": 8,
     "layers": {"3": [[0], [0], [0, 1], [0], [1], [1], [1], [1]]}}      # layer 3: expert 2 on shards 0 and 1

Shapes: T = tokens in the step, k = units per token, S = slots on one shard, U = distinct token rows on one shard,
D = hidden.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NewType

import torch

from shared.model.config import ModelConfig

ShardId = NewType("ShardId", int)
ExpertId = NewType("ExpertId", int)
Unit = tuple[int, int]                      # (layer, expert or dense slice)

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")   # Mixtral, Qwen-MoE, DeepSeek-V3


def num_routed_experts(cfg: ModelConfig) -> int:
    """Routed experts per MoE layer as the checkpoint's config names them; 0 for a dense model."""
    for key in _EXPERT_KEYS:
        if cfg.extra.get(key):
            return int(cfg.extra[key])
    return 0


def dense_slice(inter: int, index: int, num_slices: int) -> tuple[int, int]:
    """Intermediate neurons [lo, hi) of slice `index` of a dense FFN of width `inter` split `num_slices` ways."""
    return index * inter // num_slices, (index + 1) * inter // num_slices


def contiguous_shard(unit: int, num_units: int, num_shards: int) -> ShardId:
    return ShardId(unit * num_shards // num_units)


@dataclass(frozen=True, slots=True)
class Placement:
    num_shards: int
    num_experts: int = 0                    # routed experts per MoE layer (0: dense model)
    layers: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)   # layer -> shards of each unit
    replicas: int = 1                       # shards holding each unit of a layer not in `layers` (its contiguous
                                            # shard first, then the next ones): num_shards = every shard holds all

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {self.num_shards}")
        if not 1 <= self.replicas <= self.num_shards:
            raise ValueError(f"replicas must be in [1, {self.num_shards}] (the shard count), got {self.replicas}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        for layer, table in self.layers.items():
            if len(table) not in (self.num_shards, self.num_experts):
                raise ValueError(f"placement of layer {layer} lists {len(table)} units; expected {self.num_experts} "
                                 f"experts or {self.num_shards} dense slices")
            for unit, shards in enumerate(table):
                if not shards or len(set(shards)) != len(shards) or not all(0 <= s < self.num_shards for s in shards):
                    raise ValueError(f"placement of layer {layer} unit {unit}: shards {list(shards)} must be distinct "
                                     f"and in [0, {self.num_shards})")

    def num_units(self, dense: bool) -> int:
        return self.num_shards if dense else self.num_experts

    def shards(self, layer: int, unit: int, dense: bool) -> tuple[int, ...]:
        """The shards holding `unit` of `layer`, primary first."""
        table = self.layers.get(layer)
        if table is not None:
            if len(table) != self.num_units(dense):
                raise ValueError(f"placement of layer {layer} lists {len(table)} units but the layer has "
                                 f"{self.num_units(dense)} ({'dense slices' if dense else 'experts'})")
            return table[unit]
        first = contiguous_shard(unit, self.num_units(dense), self.num_shards)
        return tuple((first + i) % self.num_shards for i in range(self.replicas))

    def holds(self, shard: int, layer: int, unit: int, dense: bool) -> bool:
        return shard in self.shards(layer, unit, dense)

    def table(self, layer: int, dense: bool) -> tuple[tuple[int, ...], ...]:
        """Shards of every unit of `layer`."""
        return tuple(self.shards(layer, u, dense) for u in range(self.num_units(dense)))

    def with_layers(self, layers: dict[int, tuple[tuple[int, ...], ...]]) -> "Placement":
        return Placement(self.num_shards, self.num_experts, {**self.layers, **layers}, self.replicas)

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        return {"num_shards": self.num_shards, "num_experts": self.num_experts, "replicas": self.replicas,
                "layers": {str(k): [list(s) for s in v] for k, v in sorted(self.layers.items())}}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Placement":
        try:
            layers = {int(k): tuple(tuple(int(s) for s in shards) for shards in v)
                      for k, v in obj.get("layers", {}).items()}
            return cls(int(obj["num_shards"]), int(obj.get("num_experts", 0)), layers, int(obj.get("replicas", 1)))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"a placement needs num_shards, num_experts and layers {{layer: [[shard, ...], ...]}}: "
                             f"{e}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


REPLICATED = "replicated"


def load_placement(path: str | None, num_shards: int, num_experts: int) -> Placement:
    """The placement in `path` (checked against the shard count and the model), the contiguous one where there is
    none, or with "replicated" every unit on every shard (a shard may die: the others serve its units)."""
    if not path:
        return Placement(num_shards, num_experts)
    if path == REPLICATED:
        return Placement(num_shards, num_experts, replicas=num_shards)
    with open(path) as f:
        p = Placement.from_json(json.load(f))
    if (p.num_shards, p.num_experts) != (num_shards, num_experts):
        raise ValueError(f"placement {path} is for {p.num_shards} shards and {p.num_experts} experts per layer, "
                         f"but there are {num_shards} shards and the model has {num_experts}")
    return p


# ---------------------------------------------------------------- dispatch and combine (pure)
@dataclass(slots=True)
class ShardSlots:
    """The slots of one layer and step that one shard computes."""
    slots: torch.Tensor          # [S] int64 flat positions t * k + j in the step's [T, k] routing
    rows: torch.Tensor           # [U] int64 token rows, ascending and distinct
    slot_rows: torch.Tensor      # [S] int64 index into rows of each slot

    @property
    def one_row_per_slot(self) -> bool:
        return self.slots.numel() == self.rows.numel()      # then slot_rows is 0..S-1 (slots ascend by token)


def replica_table(table: tuple[tuple[int, ...], ...], avoid: frozenset[int] = frozenset()
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unit, its shards not in `avoid` (all of them if every one is) -> ([units, R] padded, [units] counts)."""
    live = [[s for s in shards if s not in avoid] or list(shards) for shards in table]
    width = max(len(x) for x in live)
    padded = torch.tensor([x + [x[0]] * (width - len(x)) for x in live], dtype=torch.int64)
    return padded, torch.tensor([len(x) for x in live], dtype=torch.int64)


def plan_dispatch(unit_ids: torch.Tensor, replicas: tuple[torch.Tensor, torch.Tensor],
                  slots: torch.Tensor | None = None) -> dict[int, ShardSlots]:
    """Groups the (token, unit) slots of one layer by shard.

    unit_ids [T, k]; replicas from `replica_table`; `slots` restricts the plan to some flat positions (a retry).
    A unit with several replicas spreads its tokens over them (token t -> replica t mod R), which balances load
    and never changes outputs."""
    k = unit_ids.shape[1]
    flat = unit_ids.reshape(-1).long()                                   # [T k]
    pos = torch.arange(flat.numel()) if slots is None else slots         # [P]
    units, tokens = flat[pos], pos // k
    table, counts = replicas
    shard = table[units, tokens % counts[units]]                         # [P]
    out: dict[int, ShardSlots] = {}
    for s in torch.unique(shard).tolist():                               # ascending shard order
        mine = pos[shard == s]                                           # [S]
        rows, slot_rows = torch.unique(mine // k, return_inverse=True)   # [U], [S]
        out[s] = ShardSlots(mine, rows, slot_rows)
    return out


def combine(num_tokens: int, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sums the shards' outputs: parts of (rows [U], output [U, D]), in shard order -> [T, D]."""
    out = torch.zeros(num_tokens, parts[0][1].shape[1], dtype=parts[0][1].dtype)
    for rows, y in parts:
        if rows.numel() == num_tokens:                                   # rows is 0..T-1
            out += y
        else:
            out.index_add_(0, rows, y)
    return out
