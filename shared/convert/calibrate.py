"""Calibration for `--policy auto`: run the full-precision model on calibration text in the engine and measure each
linear unit's NVFP4 error (shared.quant.policy turns the measurements into a per-layer precision choice)."""
from __future__ import annotations

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.quant.nvfp4 import NVFP4Weight, global_scale_from_amax, quantise_weight
from shared.quant.nvfp4_module import NVFP4Linear
from shared.quant.policy import Sensitivity


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref||_F / ||ref||_F."""
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def measure(src: str, units: dict[str, tuple[tuple[str, ...], tuple[int, ...]]], token_ids: list[int],
            act_quant: bool = False) -> tuple[dict[str, Sensitivity], dict[str, NVFP4Weight], torch.nn.Module]:
    """Runs the full-precision model at `src` on token_ids and measures every given unit
    ({unit name: (its checkpoint layer names, their rows)}) with forward hooks:

    - on the unit: its input x [T, K], then its own output error with an NVFP4Linear (W4A4: x fake-quantised
      with the static scale 448*6/amax(x)) in place of the dense weight;
    - on its block (the parent module: self_attn or mlp): the block's forward is run again on the same inputs with
      only this unit swapped for its NVFP4Linear, and its output error recorded. That error, which sees the
      softmax behind q/k and the gating behind gate/up, ranks layers; the unit's own output error does not
      (on SmolLM2 it ranks o_proj first, which moves perplexity least). The single calibration sequence is one
      full prefill, so each rerun rewrites every K/V slot it reads.

    Also returns the NVFP4 weight of every checkpoint layer it quantised, by name, and the loaded model, for the
    writer to reuse rather than quantise or read the checkpoint again.
    """
    engine = LLMEngine(EngineConfig(model=src, dtype="float32", progress=False, enable_prefix_caching=False,
                                    num_kv_blocks=len(token_ids) // 16 + 2))
    model = engine.runner.model
    m = _Measurement(act_quant)
    handles = [model.get_submodule(u).register_forward_hook(m.unit_hook(u, *v)) for u, v in units.items()]
    blocks: dict[str, list[str]] = {}
    for u in units:
        if "." in u:                     # a top-level unit (lm_head) is its own block: block error = own error
            blocks.setdefault(u.rpartition(".")[0], []).append(u)
    for b, names in blocks.items():
        block = model.get_submodule(b)
        handles.append(block.register_forward_hook(m.block_hook(block, names)))
    try:
        engine.score(token_ids)
    finally:
        for h in handles:
            h.remove()
    return m.found, m.quantised, model


class _Measurement:
    """The forward hooks of `measure` and what they find."""

    def __init__(self, act_quant: bool) -> None:
        self.act_quant = act_quant
        self.found: dict[str, Sensitivity] = {}
        self.quantised: dict[str, NVFP4Weight] = {}
        self.swaps: dict[str, NVFP4Linear] = {}
        self.rerunning = False                   # a block's forward run again: the units' hooks keep still

    def unit_hook(self, name: str, layers: tuple[str, ...], segments: tuple[int, ...]):
        def run(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
            if self.rerunning:
                return
            x = inputs[0]                                                       # [T, K]
            amax = x.float().abs().amax()
            aq = self.act_quant
            igs = global_scale_from_amax(amax) if aq else None
            q = NVFP4Linear(module.in_features, segments, module.bias is not None, aq, aq, x.device)
            for i, (layer, rows) in enumerate(zip(layers, torch.split(module.weight.float(), list(segments)))):
                self.quantised[layer] = w = quantise_weight(rows)
                q.load_segment(i, NVFP4Weight(w.packed, w.scale, w.global_scale, igs), layer)
            if module.bias is not None:
                q.bias.data.copy_(module.bias)
            self.swaps[name] = q
            err = _rel(q(x), y)
            self.found[name] = Sensitivity(name, segments, module.in_features, err, err, float(amax))
        return run

    def block_hook(self, block: torch.nn.Module, names: list[str]):
        def run(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            self.rerunning = True
            try:
                for name in names:
                    short = name.rpartition(".")[2]
                    dense = getattr(block, short)
                    setattr(block, short, self.swaps[name])
                    try:
                        self.found[name].block_error = _rel(block.forward(*args), out)
                    finally:
                        setattr(block, short, dense)
            finally:
                self.rerunning = False
        return run
