"""Serving a GGUF file's quantised linear layers as they are stored: swap them for QuantLinear before loading.

    build_model:  model on meta -> consume = pack_gguf_linears(model, types) -> to_empty
                  model.load_weights(consume(iter_weights(..., raw=consume.raw)))

A linear unit (q/k/v fused, gate/up fused, or a lone layer) is kept packed when every checkpoint layer in it is of
a type shared.quant.gguf_blocks reads and the kernel runs on this machine; its weights then arrive from the stream
as GGUFRaw and go straight into the layer's segments, never dequantised. An LM head tied to a packed-type embedding
(the default model's Q8_0 `token_embd`) becomes a QuantLinear of the embedding's codes, and the embedding itself is
dequantised from the same bytes for its lookups. Everything else loads as before (dequantised to the model's
dtype): norms, expert stacks, and every layer where the kernel cannot run.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shared.ops import qgemm
from shared.quant.gguf_blocks import PACKED_TYPES, GGUFRaw
from shared.quant.model_quant import linear_units
from shared.quant.quant_linear import QuantLinear

log = logging.getLogger(__name__)

Weights = Iterator[tuple[str, Any]]


class GGUFConsumer:
    """Takes the packed layers' GGUFRaw tensors out of a weight stream into their QuantLinear segments."""

    def __init__(self, targets: dict[str, tuple[QuantLinear, int]], keep_dense: frozenset[str] = frozenset()) -> None:
        self.targets = targets                   # "model.layers.0.self_attn.q_proj.weight" -> (layer, segment)
        self.keep_dense = keep_dense             # tensors also loaded dequantised (an embedding a head is tied to)

    def raw(self, name: str) -> bool:
        """Whether the stream should yield tensor `name` as it is stored."""
        return name in self.targets

    def __call__(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        loaded = set()
        for name, t in weights:
            if not isinstance(t, GGUFRaw):
                yield name, t
                continue
            module, index = self.targets[name]
            bq = t.block_quant()
            module.load_segment(index, bq, name)
            loaded.add(name)
            if name in self.keep_dense:
                yield name, bq.dequantise()
        missing = sorted(self.targets.keys() - loaded)
        if missing:
            raise ValueError(f"the GGUF stream lacked {len(missing)} packed layers, e.g. {missing[:3]}")


EMBEDDING = "model.embed_tokens.weight"


def pack_gguf_linears(model: nn.Module, types: Mapping[str, Any], tied_head: bool = False
                      ) -> Callable[[Weights], Weights]:
    """Replaces the linear units of `model` whose checkpoint layers (by Hugging Face weight name in `types`, their
    GGML types) all stay packed, and with `tied_head` its LM head by the embedding's codes; returns the stream
    filter that loads them (the identity when nothing is packed)."""
    if not qgemm.available():
        if any(t in PACKED_TYPES for t in types.values()):
            log.info("the quantised kernel does not run on this CPU (it needs AVX512-BF16): the GGUF's quantised "
                     "layers are dequantised at load")
        return lambda weights: weights
    targets: dict[str, tuple[QuantLinear, int]] = {}
    dense_types: set[str] = set()
    keep_dense: frozenset[str] = frozenset()
    head = getattr(model, "lm_head", None)
    if tied_head and isinstance(head, nn.Linear) and types.get(EMBEDDING) in PACKED_TYPES:
        model.lm_head = QuantLinear(head.in_features, [head.out_features], device=head.weight.device)
        targets[EMBEDDING], keep_dense = (model.lm_head, 0), frozenset({EMBEDDING})
    for unit in linear_units(model):
        names = [f"{n}.weight" for n in unit.hf_names]
        if not all(types.get(n) in PACKED_TYPES for n in names):
            dense_types.update(getattr(types.get(n), "name", "?") for n in names if types.get(n) not in PACKED_TYPES)
            continue
        device = model.get_submodule(unit.name).weight.device
        module = QuantLinear(unit.in_features, unit.segments, unit.bias, device=device)
        parent, _, short = unit.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, short, module)
        for i, n in enumerate(names):
            targets[n] = (module, i)
    quantised = dense_types - {"F32", "F16", "BF16", "F64", "?"}
    if quantised:                                # a file's types this kernel does not read: say so, not silently
        log.info("GGUF layers of types %s are dequantised at load (kept packed: %s)", sorted(quantised),
                 ", ".join(sorted(t.name for t in PACKED_TYPES)))
    return GGUFConsumer(targets, keep_dense) if targets else (lambda weights: weights)
