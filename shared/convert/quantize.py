"""`upesi quantize`: a GGUF or Hugging Face checkpoint -> a compressed-tensors NVFP4 Hugging Face folder.

    out/config.json          the source's config (synthesised for a GGUF) + quantization_config
    out/model.safetensors    NVFP4 layers: weight_packed, weight_scale, weight_global_scale (+ input_global_scale
                             for W4A4); FP8 layers: weight (e4m3), weight_scale; bf16 / fp32 layers: weight;
                             norms and biases fp32
    out/tokenizer*, chat_template.jinja, generation_config.json    when the source has them

Without calibration the weights stream through one tensor at a time (shared.model.loader.iter_weights), so the
peak is the output plus one dense tensor. Calibration (the auto policy, W4A4 input scales) loads the source in the
engine to capture activations (shared.convert.calibrate.measure) and then converts that model's weights, so the
checkpoint is read once either way.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from shared.convert.calibrate import measure
from shared.convert.checkpoint_folder import copy_tokenizer, write_config
from shared.model.config import ModelConfig
from shared.model.loader import iter_weights, load_config
from shared.model_files import is_gguf, resolve_model_path
from shared.quant import policy as pol
from shared.quant.checkpoint import to_compressed_tensors
from shared.quant.model_quant import hf_name, linear_units
from shared.quant.nvfp4 import NVFP4Weight, global_scale_from_amax
from shared.quant.nvfp4_module import fp8_quantise

@dataclass(slots=True)
class QuantizeResult:
    out: str
    unit_precisions: dict[str, pol.Precision]       # our linear modules (qkv_proj, ...) -> precision
    layer_precisions: dict[str, pol.Precision]      # checkpoint layers (q_proj, ..., embed_tokens) -> precision
    weight_bytes: int                               # bytes of every tensor written
    num_params: int
    seconds: float
    sensitivity: dict[str, pol.Sensitivity] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def report(self) -> str:
        counts = {p: sum(1 for v in self.unit_precisions.values() if v == p) for p in pol.PRECISIONS}
        lines = [pol.sensitivity_table(self.sensitivity, self.unit_precisions)] if self.sensitivity else []
        lines += [f"  {p:<6} {n} linear units" for p, n in counts.items() if n]
        kept = sorted(u for u, p in self.unit_precisions.items() if p != "nvfp4")
        if kept and not self.sensitivity:
            lines.append("  not NVFP4: " + ", ".join(f"{u} ({self.unit_precisions[u]})" for u in kept))
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"wrote {self.out}: {self.weight_bytes / 1e6:.1f} MB of weights, "
                     f"{8 * self.weight_bytes / self.num_params:.2f} bits/param, {self.seconds:.1f} s")
        return "\n".join(lines)


def quantize(src: str | None, out: str, policy: str | None = None, memory_budget: str | int | None = None,
             keep: pol.Precision = "bf16", act_quant: bool = False, calibration: str | list[int] | None = None,
             progress: bool = True, lm_head: pol.Precision | None = None) -> QuantizeResult:
    """Writes the NVFP4 checkpoint of `src` (None = the default GGUF) to the folder `out`.

    policy: None (defaults: linears NVFP4, lm_head and embeddings bf16), a JSON/YAML rule file, or "auto" with
    memory_budget (bytes or "120MB"): the most sensitive units are kept in `keep` precision while they fit.
    act_quant: also calibrate input_global_scale and write a W4A4 (NVFP4) config instead of NVFP4A16.
    calibration: text or token ids for the auto policy / act_quant (default: a built-in held-out text,
    tokenised with the source's tokenizer). lm_head: the LM head's precision, over the policy; a head tied to the
    embeddings and quantised is written untied (the embeddings stay bf16 / fp32 for the lookup).
    Raises PolicyError for a policy or budget that cannot be used.
    """
    t0 = time.perf_counter()
    src = resolve_model_path(src)
    cfg = load_config(src)
    if cfg.extra.get("quantization_config"):
        raise pol.PolicyError(f"{src} is already quantised; quantize its full-precision original")
    rules = _rules(policy, memory_budget, lm_head)
    untied = cfg.tie_word_embeddings and pol.precision_of("lm_head", rules) in ("nvfp4", "fp8")
    cfg = replace(cfg, tie_word_embeddings=False) if untied else cfg     # a quantised head gets its own tensors
    units = _units(cfg)                                          # unit -> (checkpoint names, rows, in features)
    chosen, notes = _chosen(units, rules)
    if policy == "auto":
        budget, base = _auto_budget(cfg, units, chosen, rules, act_quant, memory_budget, keep)

    calibrate = policy == "auto" or act_quant
    text = calibrate and not isinstance(calibration, list)
    tokenizer = _tokenizer(src) if is_gguf(src) or text else None
    found: dict[str, pol.Sensitivity] = {}
    quantised: dict[str, NVFP4Weight] = {}
    weights = None
    if calibrate:
        ids = calibration if isinstance(calibration, list) else tokenizer.encode(calibration or pol.CALIBRATION_TEXT)
        if not ids:
            raise pol.PolicyError("the calibration text is empty")
        targets = {u: v[:2] for u, v in units.items() if chosen[u] == "nvfp4" and u != "lm_head"}  # head: no hook
        found, quantised, model = measure(src, targets, ids, act_quant)
        weights = _model_weights(model, units)          # the loaded model, not a second read of the checkpoint
    if policy == "auto":
        for u in pol.choose(found, budget - base, keep, act_quant):
            chosen[u] = keep
        notes.append(f"budget {budget / 1e6:.1f} MB, all-NVFP4 {base / 1e6:.1f} MB, "
                     f"chosen {_weight_bytes(cfg, units, chosen, rules, act_quant) / 1e6:.1f} MB")

    layers = {n: chosen[u] for u, (names, _, _) in units.items() for n in names}
    layers[pol.EMBEDDINGS] = pol.precision_of(pol.EMBEDDINGS, rules)
    amax = {n: found[u].input_amax for u, (names, _, _) in units.items() for n in names if u in found}
    weights = weights if weights is not None else _our_names(iter_weights(src, cfg, progress=False), cfg)
    weights = _with_head(weights) if untied and not calibrate else weights
    tensors = _convert(weights, cfg, layers, amax if act_quant else {}, quantised, progress)

    _write(out, tensors, src, cfg, layers, act_quant, tokenizer)
    return QuantizeResult(out, chosen, layers, sum(t.nbytes for t in tensors.values()), _num_params(tensors),
                          time.perf_counter() - t0, found, notes)


def _rules(policy: str | None, memory_budget: str | int | None, lm_head: pol.Precision | None) -> list:
    """The rules a run applies: the defaults, then the policy file's, then the LM head's precision."""
    if (memory_budget is not None) != (policy == "auto"):
        raise pol.PolicyError("--memory-budget goes with --policy auto, and --policy auto needs a --memory-budget")
    rules = pol.DEFAULT_RULES + (pol.load_rules(policy) if policy not in (None, "auto") else [])
    return rules + ([("lm_head", lm_head)] if lm_head is not None else [])


def _write(out: str, tensors: dict[str, torch.Tensor], src: str, cfg: ModelConfig, layers: dict[str, str],
           act_quant: bool, tokenizer) -> None:
    """The checkpoint folder: model.safetensors, config.json with its quantization_config, the tokenizer."""
    os.makedirs(out, exist_ok=True)
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_config(src, cfg, out, layers, act_quant)
    copy_tokenizer(src, out, tokenizer)


def _chosen(units: dict, rules) -> tuple[dict[str, pol.Precision], list[str]]:
    """Each unit's precision by the rules, and notes on units kept apart from them."""
    chosen, notes = pol.resolve({u: v[0] for u, v in units.items()}, rules)
    for u, (_, _, k) in units.items():            # NVFP4 blocks run along K in 16s: a narrower K cannot be packed
        if chosen[u] == "nvfp4" and k % 16:
            chosen[u] = "bf16"
            notes.append(f"{u}: {k} input features are not a multiple of 16, kept in bf16")
    return chosen, notes


def _auto_budget(cfg: ModelConfig, units: dict, chosen: dict[str, pol.Precision], rules, act_quant: bool,
                 memory_budget: str | int | None, keep: pol.Precision) -> tuple[int, int]:
    """The auto policy's (budget, all-NVFP4 size) in bytes; PolicyError where it cannot be met."""
    budget, base = pol.parse_size(memory_budget or 0), _weight_bytes(cfg, units, chosen, rules, act_quant)
    if budget < base:
        raise pol.PolicyError(f"memory budget {budget / 1e6:.1f} MB is below the all-NVFP4 size "
                              f"{base / 1e6:.1f} MB; raise it")
    if keep not in ("fp8", "bf16", "fp32"):
        raise pol.PolicyError(f"the auto policy keeps sensitive layers in fp8, bf16 or fp32, not {keep!r}")
    return budget, base


def _num_params(tensors: dict[str, torch.Tensor]) -> int:
    """Parameters the tensors stand for: two per packed NVFP4 byte; scales are not parameters."""
    scales = ("weight_scale", "weight_global_scale", "input_global_scale")
    return sum(2 * t.numel() if n.endswith("weight_packed") else t.numel()
               for n, t in tensors.items() if not n.endswith(scales))


def _units(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], int]]:
    """Our model's linear units, from the architecture built on the meta device (no memory, no weights).

    Raises PolicyError for an architecture with weight matrices that are not nn.Linear (batched MoE experts, say),
    which this command would otherwise leave in fp32 unnoticed.
    """
    from shared.model.moe import Router
    from shared.model.registry import ARCHITECTURES
    if cfg.architecture not in ARCHITECTURES:
        raise pol.PolicyError(f"architecture {cfg.architecture!r} is not supported; known: {sorted(ARCHITECTURES)}")
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture](cfg, 16)
    units = linear_units(model)
    covered = {f"{u.name}.weight" for u in units}
    covered |= {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    covered |= {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Router)}   # MoE gates: kept fp32
    others = [n for n, p in model.named_parameters() if p.ndim >= 2 and n not in covered]
    if others:
        raise pol.PolicyError(f"{cfg.architecture}: {len(others)} weight tensors are not linear layers this command "
                              f"quantises (e.g. {others[:2]}); it handles dense Llama-family models for now")
    return {u.name: (u.hf_names, u.segments, u.in_features) for u in units}


def _weight_bytes(cfg: ModelConfig, units: dict, chosen: dict[str, pol.Precision], rules, act_quant: bool) -> int:
    """Checkpoint weight bytes these precisions give (linears, embeddings, fp32 norms; biases left out)."""
    total = sum(pol.bytes_per_layer(chosen[u], r, k, act_quant) for u, (_, rows, k) in units.items() for r in rows)
    embed = pol.bytes_per_layer(pol.precision_of(pol.EMBEDDINGS, rules), cfg.vocab_size, cfg.hidden_size)
    norms = 4 * cfg.hidden_size * (2 * cfg.num_layers + 1)
    return total + embed + norms


def _our_names(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under the names our model's layers have (Mixtral's block_sparse_moe.experts.E.w1 ->
    mlp.experts.E.gate_proj, Phi-3's qkv_proj -> q/k/v_proj, ...), the names the policy, the precisions and the
    written config use."""
    from shared.model.registry import ARCHITECTURES
    cls = ARCHITECTURES[cfg.architecture]
    renames = getattr(cls, "_RENAMES", ())
    split = getattr(cls, "split_fused", None)           # Phi-3's fused qkv / gate_up: one tensor per projection
    if split is not None:
        weights = split(weights, cfg)
    for name, w in weights:
        for old, new in renames:
            name = name.replace(old, new)
        yield name, w


def _with_head(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A tied checkpoint's tensors plus `lm_head.weight`, the embeddings' copy (a checkpoint that has one keeps it)."""
    embed, head = None, False
    for name, w in weights:
        embed = w if name == f"{pol.EMBEDDINGS}.weight" else embed
        head = head or name == "lm_head.weight"
        yield name, w
    if not head:
        if embed is None:
            raise pol.PolicyError("the checkpoint has neither an LM head nor embeddings to quantise it from")
        yield "lm_head.weight", embed


def _tokenizer(src: str):
    """The source's tokenizer (shared.tokenizer.Tokenizer), loaded once: calibration text and the GGUF export."""
    from shared.tokenizer import Tokenizer
    try:
        return Tokenizer(src)
    except (OSError, ValueError) as e:
        raise pol.PolicyError(f"{src} has no tokenizer to encode the calibration text ({e}); pass token ids") from e


def _model_weights(model: torch.nn.Module, units: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """A loaded model's tensors under their checkpoint names: fused units split back into their layers."""
    for unit, (names, segments, _) in units.items():
        module = model.get_submodule(unit)
        for leaf in ("weight", "bias"):
            if getattr(module, leaf, None) is not None:
                for name, t in zip(names, torch.split(getattr(module, leaf).detach(), list(segments))):
                    yield f"{name}.{leaf}", t
    for name, p in model.named_parameters():                  # a tied head is the embeddings' duplicate: skipped
        if name.rpartition(".")[0] not in units:
            yield hf_name(name), p.detach()


def _convert(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, layers: dict[str, pol.Precision],
             amax: dict[str, float], quantised: dict[str, NVFP4Weight], progress: bool) -> dict[str, torch.Tensor]:
    """Converts each checkpoint-named tensor to its precision (reusing the NVFP4 weights calibration made)."""
    out: dict[str, torch.Tensor] = {}
    total = 9 * cfg.num_layers + 2 + (0 if cfg.tie_word_embeddings else 1)   # Llama family: a guess for the bar
    for name, w in tqdm(weights, desc="Quantising", total=total, unit="tensor", disable=not progress):
        w = w.cpu()
        prefix, _, leaf = name.rpartition(".")
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        precision = layers.get(prefix) if leaf == "weight" else None
        if precision == "nvfp4":
            igs = global_scale_from_amax(amax[prefix]) if prefix in amax else None
            out.update({k: v.cpu() for k, v in to_compressed_tensors(prefix, quantised.pop(prefix, w), igs).items()})
        elif precision == "fp8":
            out[name], out[f"{prefix}.weight_scale"] = fp8_quantise(w)
        elif precision is not None:
            out[name] = w.to(torch.bfloat16 if precision == "bf16" else torch.float32).contiguous()
        else:                                                     # norms and biases: tiny, kept in fp32
            out[name] = w.float().contiguous()
    return out
