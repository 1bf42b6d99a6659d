"""Serving quantised checkpoints: swap a model's linear layers for NVFP4Linear / FP8Linear before its weights load.

Names: an HF name is a checkpoint layer (`model.layers.0.self_attn.q_proj`); a unit is one of our linear modules
(`layers.0.self_attn.qkv_proj`), which may fuse several HF layers as row segments (the model's `_FUSED` map).

    build_model:  model on meta -> consume = apply_quantization(model, config, path) -> to_empty
                  model.load_weights(consume(iter_weights(...)))

`consume` takes each quantised layer's tensors out of the stream (weight_packed, weight_scale, weight_global_scale,
input_global_scale; or an FP8 weight and weight_scale) and copies them into its rows of the unit; biases and every
other tensor go on to load_weights unchanged. Which layers are quantised comes from the config's config_groups and
ignore list, matched as vLLM does: ignored names first, then exact names, then "re:" regexes, then the class
"Linear". The layers of one fused unit must share a scheme (the quantize command guarantees it).
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import torch
from torch import nn

from shared.quant.checkpoint import (CheckpointFormatError, _is_ct_nvfp4_group, detect_layout, load_compressed_tensors,
                                     load_modelopt)
from shared.quant.nvfp4_module import FP8Linear, NVFP4Linear

Weights = Iterator[tuple[str, torch.Tensor]]
Scheme = Literal["nvfp4", "fp8", "modelopt"]
NEEDED: dict[Scheme, tuple[str, ...]] = {"nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
                                         "fp8": ("weight", "weight_scale"),
                                         "modelopt": ("weight", "weight_scale", "weight_scale_2")}
# ModelOpt's KV-cache scales: the cache stays in the model's dtype here
_MODELOPT_DROPPED = ("k_scale", "v_scale")


@dataclass(slots=True, frozen=True)
class Unit:
    """One linear module of our model and the checkpoint layers it holds, one per row segment."""
    name: str                      # layers.0.self_attn.qkv_proj
    hf_names: tuple[str, ...]      # model.layers.0.self_attn.q_proj, ...k_proj, ...v_proj
    segments: tuple[int, ...]      # rows of each
    in_features: int
    bias: bool


def hf_name(name: str) -> str:
    """Our module name -> the checkpoint's (load_weights strips the "model." prefix the other way)."""
    return name if name.startswith("lm_head") else f"model.{name}"


def linear_units(model: nn.Module) -> list[Unit]:
    """Every nn.Linear of the model with its checkpoint layers; a head tied to the embeddings is left out."""
    parts: dict[str, list[str]] = {}
    for short, (fused, index) in getattr(model, "_FUSED", {}).items():
        parts.setdefault(fused, []).insert(index, short)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    units = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or id(mod.weight) in tied:
            continue
        prefix, _, short = name.rpartition(".")
        if short in parts:
            # as load_weights: q/k/v rows from the config; gate/up halves of this module's own rows (MoE experts,
            # shared experts and dense MLPs differ in width)
            offsets = model._fused_offsets(short) if short == "qkv_proj" else [0, mod.out_features // 2,
                                                                                mod.out_features]
            segments = tuple(b - a for a, b in pairwise(offsets))
            if sum(segments) != mod.out_features:
                raise CheckpointFormatError(f"{name}: fused rows {segments} do not add up to {mod.out_features}")
            names = tuple(hf_name(f"{prefix}.{s}" if prefix else s) for s in parts[short])
        else:
            segments, names = (mod.out_features,), (hf_name(name),)
        units.append(Unit(name, names, segments, mod.in_features, mod.bias is not None))
    return units


def _matches(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def _group_scheme(group: Mapping[str, Any]) -> Scheme:
    if _is_ct_nvfp4_group(group):
        return "nvfp4"
    w = group.get("weights") or {}
    if w.get("num_bits") == 8 and w.get("type") == "float" and w.get("symmetric", True) \
            and w.get("strategy") in ("channel", "tensor"):
        return "fp8"          # activations, if the group quantises them, run in high precision here
    raise CheckpointFormatError(f"compressed-tensors weights {dict(w)} are not a scheme this server runs "
                                "(NVFP4, or FP8 E4M3 per channel / per tensor)")


def scheme_of(name: str, qc: Mapping[str, Any]) -> tuple[Scheme, Mapping[str, Any]] | None:
    """The scheme (and its config group) that quantises checkpoint layer `name`, or None for high precision."""
    if any(_matches(name, t) for t in qc.get("ignore") or []):
        return None
    groups = list((qc.get("config_groups") or {}).values())
    for test in (lambda t: not t.startswith("re:") and t == name,
                 lambda t: t.startswith("re:") and _matches(name, t),
                 lambda t: t == "Linear"):
        for g in groups:
            if any(test(t) for t in g.get("targets") or []):
                return _group_scheme(g), g
    return None


def apply_quantization(model: nn.Module, cfg_dict: Mapping[str, Any], path: str,
                       act_quant: bool = False) -> Callable[[Weights], Weights]:
    """Replaces the quantised linear units of `model` (best on the meta device, before to_empty) and returns the
    filter that loads their tensors; the identity for an unquantised checkpoint.

    act_quant=True emulates W4A4 on the NVFP4 layers (with the checkpoint's input_global_scale when it has one,
    else a dynamic one); False runs W4A16. Raises CheckpointFormatError for layouts or schemes not served.
    """
    qc = cfg_dict.get("quantization_config")
    modelopt = modelopt_config(qc, path)
    if modelopt is not None:
        return _apply_modelopt(model, modelopt, path, act_quant)
    if not qc:
        return lambda weights: weights
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointFormatError(f"quantization method {qc.get('quant_method')!r} is not supported "
                                    "(compressed-tensors NVFP4 / FP8 only)")
    targets: dict[str, tuple[nn.Module, int, str]] = {}
    for unit in linear_units(model):
        found = [scheme_of(n, qc) for n in unit.hf_names]
        if all(f is None for f in found):
            continue
        kinds = {None if f is None else f[0] for f in found}
        if len(kinds) > 1:
            raise CheckpointFormatError(f"{unit.hf_names} are fused into {unit.name} but quantised differently "
                                        f"({[None if f is None else f[0] for f in found]}); requantise them alike")
        scheme, group = found[0]
        device = model.get_submodule(unit.name).weight.device
        if scheme == "nvfp4":
            module: nn.Module = NVFP4Linear(unit.in_features, unit.segments, unit.bias, act_quant,
                                            input_scales=group.get("input_activations") is not None, device=device)
        else:
            module = FP8Linear(unit.in_features, unit.segments, unit.bias, device=device)
        parent, _, short = unit.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, short, module)
        for i, n in enumerate(unit.hf_names):
            targets[n] = (module, i, scheme)
    return _Consumer(targets)


def modelopt_config(qc: Mapping[str, Any] | None, path: str) -> Mapping[str, Any] | None:
    """A ModelOpt checkpoint's quantization settings (config.json's quantization_config with quant_method
    "modelopt", or hf_quant_config.json's "quantization"), or None for other checkpoints. Raises
    CheckpointFormatError for a ModelOpt algorithm other than NVFP4."""
    found = None
    if qc and qc.get("quant_method") == "modelopt":
        found = qc
    elif not qc and os.path.isdir(path) and os.path.exists(os.path.join(path, "hf_quant_config.json")):
        with open(os.path.join(path, "hf_quant_config.json")) as f:
            hq = json.load(f)
        found = hq.get("quantization", hq)
        qc = hq
    if found is None:
        return None
    if detect_layout(qc) != "modelopt":
        raise CheckpointFormatError(f"ModelOpt quant_algo {found.get('quant_algo')!r} is not served (NVFP4 is)")
    return found


def _excluded(name: str, patterns: list[str]) -> bool:
    """ModelOpt's exclude_modules: a module name, a prefix of one, or a shell glob."""
    return any(name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)


def _checkpoint_keys(path: str) -> set[str]:
    from safetensors import safe_open
    keys: set[str] = set()
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def _apply_modelopt(model: nn.Module, mo: Mapping[str, Any], path: str, act_quant: bool
                    ) -> Callable[[Weights], Weights]:
    """NVIDIA ModelOpt NVFP4 checkpoints as they are: every linear unit not in exclude_modules becomes an
    NVFP4Linear loading `weight` (the codes), `weight_scale`, and the reciprocals `weight_scale_2` and
    `input_scale` (checkpoint.load_modelopt)."""
    patterns = list(mo.get("exclude_modules") or mo.get("ignore") or [])
    with_inputs = any(k.endswith(".input_scale") for k in _checkpoint_keys(path))
    targets: dict[str, tuple[nn.Module, int, str]] = {}
    for unit in linear_units(model):
        quantised = [not _excluded(n, patterns) for n in unit.hf_names]
        if not any(quantised):
            continue
        if not all(quantised):
            raise CheckpointFormatError(f"{unit.hf_names} are fused into {unit.name} but only some are excluded "
                                        "from quantisation; requantise them alike")
        device = model.get_submodule(unit.name).weight.device
        module = NVFP4Linear(unit.in_features, unit.segments, unit.bias, act_quant, input_scales=with_inputs,
                             device=device)
        parent, _, short = unit.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, short, module)
        for i, n in enumerate(unit.hf_names):
            targets[n] = (module, i, "modelopt")
    return _Consumer(targets, drop=_MODELOPT_DROPPED)


class _Consumer:
    """Takes the quantised layers' tensors out of a weight stream and loads them; yields everything else."""

    def __init__(self, targets: dict[str, tuple[nn.Module, int, str]], drop: tuple[str, ...] = ()) -> None:
        self.targets = targets
        self.drop = drop                          # leaf names read and discarded (ModelOpt's KV-cache scales)

    def __call__(self, weights: Weights) -> Weights:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, t in weights:
            prefix, _, leaf = name.rpartition(".")
            if leaf in self.drop:
                continue
            hit = self.targets.get(prefix)
            if hit is None or leaf == "bias":
                yield name, t
                continue
            if hit[2] == "fp8" and leaf == "input_scale":   # FP8 activations run in high precision here
                continue
            got = pending.setdefault(prefix, {})
            got[leaf] = t
            if all(n in got for n in self._needed(hit)):
                self._load(prefix, pending.pop(prefix))
                loaded.add(prefix)
        for prefix, got in pending.items():           # incomplete layers: _load names what is missing
            self._load(prefix, got)
            loaded.add(prefix)
        missing = sorted(self.targets.keys() - loaded)
        if missing:
            raise CheckpointFormatError(f"the config quantises {len(missing)} layers the checkpoint has no "
                                        f"quantised tensors for, e.g. {missing[:3]}")

    @staticmethod
    def _needed(hit: tuple[nn.Module, int, str]) -> tuple[str, ...]:
        module, _, scheme = hit
        inputs = "input_scale" if scheme == "modelopt" else "input_global_scale"
        extra = (inputs,) if getattr(module, "input_global_scale", None) is not None else ()
        return NEEDED[scheme] + extra

    def _load(self, prefix: str, got: dict[str, torch.Tensor]) -> None:
        module, index, scheme = self.targets[prefix]
        if scheme in ("nvfp4", "modelopt"):
            load = load_compressed_tensors if scheme == "nvfp4" else load_modelopt
            module.load_segment(index, load({f"{prefix}.{k}": v for k, v in got.items()}, prefix), prefix)
            return
        for leaf in NEEDED["fp8"]:
            if leaf not in got:
                raise CheckpointFormatError(f"missing tensor {prefix}.{leaf} for an FP8 layer")
        weight, scale = got["weight"], got["weight_scale"].float()
        module.load_segment(index, weight, scale.expand(weight.shape[0], 1) if scale.numel() == 1 else scale, prefix)


def set_act_quant(model: nn.Module, on: bool) -> int:
    """Switches W4A4 emulation on or off for every NVFP4 layer of a loaded model; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    for m in layers:
        m.act_quant = on
    return len(layers)


def set_int8_activations(model: nn.Module) -> int:
    """Opts every block-quantised layer (NVFP4, GGUF's types kept packed) into int8 activations (shared.ops.qgemm_i8,
    W4A8 / W8A8), before its weights load; returns how many layers take it (0 where the kernel does not run here)."""
    from shared.ops import qgemm_i8
    from shared.quant.quant_linear import QuantLinear
    if not qgemm_i8.available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, (NVFP4Linear, QuantLinear))]
    for m in layers:
        m.int8_activations = True
    return len(layers)
