"""What an expert shard holds and computes: the FFN units placed on it (all layers), read from the checkpoint.

Stateless between calls: a Dispatch carries every slot it needs. Units are routed experts of MoE layers
(`layers.L.mlp.experts.E.*`, Mixtral's `block_sparse_moe.experts.E.w1/w2/w3`) or slices of dense FFNs
(`layers.L.mlp.{gate,up,down}_proj`, sliced by intermediate neurons, see shared.model.placement). Shared experts stay
on the target. Quantised checkpoints (compressed-tensors NVFP4 / FP8, as `upesi quantize` writes them, with any mix
of precisions per layer; a GGUF file's quant types) stay packed: see services.experts.packed.

Shapes: U = token rows in a call, S = slots, D = hidden, i = a unit's intermediate width.
"""
from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.experts import packed
from shared.errors import InvalidRequest
from shared.model.config import ModelConfig
from shared.model.loader import iter_weights, load_config
from shared.model.placement import Placement, Unit, dense_slice, num_routed_experts
from shared.model_files import resolve_model_path
from shared.ops import qgemm
from shared.ops.decoder_bf16 import silu_mul
from shared.ops.packed_linear import PackedLinear, packable
from shared.ops.block_quant import BlockQuant
from shared.quant.gguf_blocks import GGUFRaw

log = logging.getLogger("upesi.experts")

_LEAF = "(" + "|".join(packed.LEAVES) + ")"
_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\." + _LEAF)
_DENSE = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\." + _LEAF)
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(slots=True)
class FfnUnit:
    """SwiGLU on a slice: down(silu(gate(x)) * up(x)). A linear is a float weight or a packed module (NVFP4Linear,
    FP8Linear: the target's own, so a quantised unit computes exactly as it would in the target)."""
    gate_up: torch.Tensor | nn.Module          # [2i, D]
    down: torch.Tensor | nn.Module             # [D, i]
    gate_up_bias: torch.Tensor | None = None   # [2i]
    down_bias: torch.Tensor | None = None      # [D] (a dense layer's slice 0 only, so the sum adds it once)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = _linear(x, self.gate_up, self.gate_up_bias)                       # [S, 2i]
        return _linear(silu_mul(gate_up), self.down, self.down_bias)                 # [S, i] -> [S, D]

    @property
    def nbytes(self) -> int:
        return sum(packed.nbytes(t) for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias))


def _linear(x: torch.Tensor, w: torch.Tensor | nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    y = w(x)
    return y if bias is None else y + bias


def _prepacked(w: torch.Tensor | nn.Module) -> torch.Tensor | nn.Module:
    """A bf16 CPU weight -> a PackedLinear (shared.ops.packed_linear: same results as F.linear, about 2x faster at
    a step's few rows); anything else as it is."""
    return PackedLinear(w) if isinstance(w, torch.Tensor) and w.dim() == 2 and packable(w) else w


def ffn_forward(units: Mapping[int, FfnUnit], hidden: torch.Tensor, unit_ids: torch.Tensor,
                weights: torch.Tensor | None = None, slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The shard's compute. hidden [U, D]; per slot: unit_ids [S], weights [S] (None = 1), slot_rows [S] (None =
    slot s reads row s) -> [U, D], per row the sum of its slots' weighted unit outputs, in ascending unit order."""
    # Weights multiply in their own dtype (fp32) before the cast back, as LocalExperts does.
    present = torch.unique(unit_ids).tolist()                           # the one host sync of the call
    if slot_rows is None and len(present) == 1:                         # a dense slice, or one expert: no scatter
        y = units[present[0]](hidden)                                   # [U, D]
        return y if weights is None else (y * weights[:, None]).to(hidden.dtype)
    rows_of = slot_rows if slot_rows is not None else torch.arange(unit_ids.numel(), device=hidden.device)
    out = torch.zeros_like(hidden)                                      # [U, D]
    for u in present:
        sel = (unit_ids == u).nonzero()[:, 0]                           # [S_u]
        rows = rows_of[sel]
        y = units[u](hidden[rows])                                      # [S_u, D]
        if weights is not None:
            y = y * weights[sel, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def read_units(path: str, cfg: ModelConfig, wanted: Callable[[int, int, bool], bool], num_slices: int,
               progress: bool = False, act_quant: bool = False, int8: bool = False) -> dict[Unit, FfnUnit]:
    """Streams the checkpoint tensor by tensor (only the FFN tensors of wanted units are read or dequantised) and
    keeps the units `wanted(layer, unit, dense)` accepts; dense FFNs are cut into `num_slices` slices. Quantised
    layers stay packed (act_quant: their NVFP4 layers emulate W4A4; int8: they run on int8 activations)."""
    def keep(name: str) -> bool:
        if (m := _EXPERT.fullmatch(name)) and int(m[1]) < cfg.num_layers:
            return wanted(int(m[1]), int(m[2]), False)
        if (m := _DENSE.fullmatch(name)) and int(m[1]) < cfg.num_layers:
            return any(wanted(int(m[1]), s, True) for s in range(num_slices))
        return False

    def raw(name: str) -> bool:                  # a GGUF quant type's FFN weights stay packed where the kernel runs
        return qgemm.available() and name.endswith(".weight")

    parts: dict[Unit, dict[str, torch.Tensor | BlockQuant]] = defaultdict(dict)
    for name, w in iter_weights(path, cfg, progress, keep=keep, raw=raw):
        if isinstance(w, GGUFRaw):
            w = w.block_quant()
        if (m := _EXPERT.fullmatch(name) or _DENSE.fullmatch(name)) and int(m[1]) >= cfg.num_layers:
            continue                                                        # past the decoder (DeepSeek-V3's MTP)
        if m := _EXPERT.fullmatch(name):
            layer, expert, proj, kind = int(m[1]), int(m[2]), m[3], m[4]
            if proj in _PART and wanted(layer, expert, False):
                parts[(layer, expert)][f"{_PART[proj]}.{kind}"] = w
        elif m := _DENSE.fullmatch(name):
            layer, part, kind = int(m[1]), _PART[m[2]], m[3]
            for s in range(num_slices):
                if not wanted(layer, s, True):
                    continue
                lo, hi = dense_slice(packed.ffn_width(part, kind, w), s, num_slices)
                if part == "down":
                    if kind == "bias" and s > 0:
                        continue
                    piece = packed.slice_columns(kind, w, lo, hi)               # [D, i] (a bias whole)
                else:
                    piece = packed.slice_rows(kind, w, lo, hi)                  # [i, D] or [i]
                parts[(layer, s)][f"{part}.{kind}"] = piece                     # a copy: the whole one goes
    units = {}
    for unit, p in parts.items():
        leaves = {part: {k.split(".", 1)[1]: v for k, v in p.items() if k.startswith(part + ".") and k != "down.bias"}
                  for part in ("gate", "up", "down")}
        missing = [part for part, got in leaves.items() if "weight" not in got and "weight_packed" not in got]
        if missing:
            raise ValueError(f"checkpoint {path}: layer {unit[0]} unit {unit[1]} lacks the weights of {missing}")
        bias = torch.cat([p["gate.bias"], p["up.bias"]]) if "gate.bias" in p else None
        name = f"layer {unit[0]} unit {unit[1]}"
        gate_up = packed.fused_linear([leaves["gate"], leaves["up"]], act_quant, f"{name} gate/up", int8)
        units[unit] = FfnUnit(gate_up, packed.fused_linear([leaves["down"]], act_quant, f"{name} down", int8), bias,
                              p.get("down.bias"))
    return units


class ExpertShard:
    """The units one shard holds and their batched compute."""

    def __init__(self, model: str | None, placement: Placement, shard_index: int, dtype: torch.dtype,
                 device: torch.device, progress: bool = False, act_quant: bool = False,
                 hf_overrides: dict | None = None, int8_activations: bool = False) -> None:
        self.path = resolve_model_path(model)
        self.cfg = load_config(self.path, hf_overrides)       # the targets' --hf-overrides, so both read one config
        qc = self.cfg.extra.get("quantization_config")
        if qc and qc.get("quant_method") != "compressed-tensors":
            raise ValueError(f"{self.path}: quantization method {qc.get('quant_method')!r} is not served by expert "
                             "shards (compressed-tensors NVFP4 / FP8 only)")
        self.act_quant, self.int8 = act_quant, int8_activations
        if placement.num_experts != num_routed_experts(self.cfg):
            raise ValueError(f"the placement has {placement.num_experts} experts per layer, the model "
                             f"{num_routed_experts(self.cfg)}")
        self.placement, self.index, self.dtype, self.device = placement, shard_index, dtype, device
        self.progress = progress
        self.layers: dict[int, dict[int, FfnUnit]] = {}
        self.dispatches = self.slots = 0
        t0 = time.perf_counter()
        self._add(read_units(self.path, self.cfg, lambda layer, u, d: placement.holds(shard_index, layer, u, d),
                             placement.num_shards, progress, act_quant, self.int8))
        if not self.layers:
            raise ValueError(f"shard {shard_index} of {placement.num_shards} holds nothing of {self.path}: no FFN "
                             "tensors placed on it were found in the checkpoint")
        log.info("shard %d/%d: %d units of %d layers, %.1f MiB, read in %.1f s", shard_index, placement.num_shards,
                 self.num_units, len(self.layers), self.weight_bytes / 2**20, time.perf_counter() - t0)

    @property
    def num_units(self) -> int:
        return sum(len(u) for u in self.layers.values())

    @property
    def weight_bytes(self) -> int:
        return sum(u.nbytes for layer in self.layers.values() for u in layer.values())

    def _add(self, units: dict[Unit, FfnUnit]) -> None:
        layers = {k: dict(v) for k, v in self.layers.items()}        # readers keep the old dicts until the swap
        for (layer, u), unit in units.items():
            gate_up, down, gate_up_bias, down_bias = (packed.move(t, self.device, self.dtype) for t in (
                unit.gate_up, unit.down, unit.gate_up_bias, unit.down_bias))
            layers.setdefault(layer, {})[u] = FfnUnit(_prepacked(gate_up), _prepacked(down), gate_up_bias, down_bias)
        self.layers = layers

    def load(self, units: list[Unit]) -> int:
        """Reads more units from the checkpoint (one more pass over it); returns how many were new."""
        want = {u for u in units if u[1] not in self.layers.get(u[0], {})}
        if not want:
            return 0
        found = read_units(self.path, self.cfg, lambda layer, u, d: (layer, u) in want, self.placement.num_shards,
                           self.progress, self.act_quant, self.int8)
        if want - found.keys():
            raise InvalidRequest(f"the checkpoint has no FFN unit (layer, expert) {sorted(want - found.keys())[:8]}")
        self._add(found)
        return len(found)

    @torch.inference_mode()
    def forward(self, layer: int, hidden: torch.Tensor, unit_ids: torch.Tensor, weights: torch.Tensor | None = None,
                slot_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One Dispatch: validates the slots, computes them, returns [U, D] in the caller's dtype."""
        units = self.layers.get(layer)
        if units is None:
            raise InvalidRequest(f"shard {self.index} holds no unit of layer {layer}")
        d = self.cfg.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != d or not hidden.is_floating_point():
            raise InvalidRequest(f"hidden must be a float [rows, {d}] tensor, got {hidden.dtype} {list(hidden.shape)}")
        s = unit_ids.numel()
        if unit_ids.dim() != 1 or unit_ids.is_floating_point():
            raise InvalidRequest("expert_ids must be a 1-D integer tensor")
        if weights is not None and tuple(weights.shape) != (s,):
            raise InvalidRequest(f"weights must have shape [{s}], got {list(weights.shape)}")
        if slot_rows is None:
            if s != hidden.shape[0]:
                raise InvalidRequest(f"{s} slots but {hidden.shape[0]} hidden rows; send token_index")
        elif tuple(slot_rows.shape) != (s,) or slot_rows.is_floating_point() or (
                s and not 0 <= int(slot_rows.min()) <= int(slot_rows.max()) < hidden.shape[0]):
            raise InvalidRequest(f"token_index must be [{s}] integers in [0, {hidden.shape[0]})")
        unknown = set(torch.unique(unit_ids).tolist()) - units.keys()
        if unknown:
            raise InvalidRequest(f"shard {self.index} does not hold units {sorted(unknown)[:8]} of layer {layer}; "
                                 "LoadExperts them first")
        x = hidden.to(self.device, self.dtype)
        out = ffn_forward(units, x, unit_ids.to(self.device).long(),
                          None if weights is None else weights.to(self.device),
                          None if slot_rows is None else slot_rows.to(self.device).long())
        self.dispatches += 1
        self.slots += s
        return out.to("cpu", hidden.dtype)
