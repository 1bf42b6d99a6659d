"""Per-layer precision: which linear layers stay in high precision, from a rule file or from measured error.

A policy file is a JSON or YAML map, checkpoint layer name pattern -> "nvfp4" | "fp8" | "bf16" | "fp32":

    {"*.mlp.down_proj": "bf16", "model.layers.0.*": "fp32", "re:.*self_attn\\.[qkv]_proj": "fp8"}

Patterns are shell globs (fnmatch) or, after "re:", regexes matched from the start as compressed-tensors does.
Rules apply after the defaults (every linear NVFP4, lm_head and the embeddings bf16); the last matching rule wins.
The embeddings are looked up, not multiplied, so only bf16 / fp32 rules apply to them. The layers of one fused
unit (q/k/v, gate/up) get the most precise choice among them, since they are served as one module.

`--policy auto` (in the spirit of Transformer Engine's precision recipes): run the full-precision model on
calibration text and, with forward hooks, measure for every linear unit the relative Frobenius error

    err = ||f(x; Wq) - f(x; W)||_F / ||f(x; W)||_F        x: the captured inputs [T, ...] of f

both of the unit's own output (f = the linear) and of its block's output (f = the attention or MLP block with
only this unit in NVFP4; see measure). Units are kept in bf16 (or fp8), largest block error first, while the
checkpoint's weight memory stays within the budget.
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Precision = Literal["nvfp4", "fp8", "bf16", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("nvfp4", "fp8", "bf16", "fp32")          # least to most precise
EMBEDDINGS = "model.embed_tokens"
DEFAULT_RULES: list[tuple[str, Precision]] = [("*", "nvfp4"), ("lm_head", "bf16"), (EMBEDDINGS, "bf16")]
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

# Held-out calibration text (tests/data/english.txt, the perplexity text, is not part of it).
CALIBRATION_TEXT = """\
Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical energy. \
Inside the chloroplasts, chlorophyll absorbs mostly red and blue light, and the energy splits water molecules, \
releasing oxygen. The plant then uses carbon dioxide from the air to build sugars, which feed its growth.
To make a simple tomato sauce, warm two spoons of olive oil in a pan, add a chopped onion and cook it slowly \
until it is soft. Add garlic, a tin of tomatoes and a pinch of salt, then let it simmer for twenty minutes.
User: How do I reverse a list in Python?
Assistant: Use slicing, `items[::-1]`, which returns a new list, or call `items.reverse()` to reverse it in place.
The city of Rome was, according to legend, founded in 753 BC by Romulus. Over the following centuries it grew \
from a small settlement on the Tiber into the capital of an empire that stretched from Britain to Egypt. Its \
roads, aqueducts and laws shaped Europe long after the western empire fell in 476.
A hash table stores key-value pairs in an array. A hash function maps each key to an index; when two keys \
collide, the table either chains the entries in a list or probes for the next free slot. Lookups take constant \
time on average, as long as the table is resized before it becomes too full.
Q: What is the boiling point of water at sea level? A: 100 degrees Celsius, or 212 degrees Fahrenheit.
"""


class PolicyError(ValueError):
    """A policy file, precision name or memory budget that cannot be used; the message says how to fix it."""


def bytes_per_layer(precision: Precision, rows: int, cols: int, act_quant: bool = False) -> int:
    """Weight bytes of one [rows, cols] checkpoint layer: NVFP4 codes + fp8 block scales + fp32 global scale(s),
    FP8 values + one fp32 scale per row, or dense bf16 / fp32."""
    n = rows * cols
    if precision == "nvfp4":
        return n // 2 + n // 16 + 4 * (2 if act_quant else 1)
    if precision == "fp8":
        return n + 4 * rows
    return n * (2 if precision == "bf16" else 4)


def parse_size(text: str | int) -> int:
    """'120MB', '0.5 GiB', '123456' -> bytes (MB = 10^6, MiB = 2^20)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise PolicyError(f"memory budget {text!r} is not a size; write e.g. 120MB, 0.5GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def load_rules(path: str) -> list[tuple[str, Precision]]:
    """The (pattern, precision) rules of a JSON or YAML policy file, in file order."""
    if not Path(path).is_file():
        raise PolicyError(f"policy file {path} does not exist (give a JSON / YAML file, or 'auto')")
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise PolicyError(f"policy {path} must map layer name patterns to one of {PRECISIONS}")
    rules = []
    for pattern, precision in data.items():
        if precision not in PRECISIONS:
            raise PolicyError(f"policy {path}: {pattern!r} -> {precision!r}; use one of {PRECISIONS}")
        rules.append((str(pattern), precision))
    return rules


def matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def precision_of(name: str, rules: list[tuple[str, Precision]]) -> Precision:
    """The last matching rule's precision (embeddings: the last matching bf16 / fp32 rule)."""
    found: Precision = "bf16"
    for pattern, precision in rules:
        if matches(name, pattern) and (name != EMBEDDINGS or precision in ("bf16", "fp32")):
            found = precision
    return found


def resolve(units: dict[str, tuple[str, ...]], rules: list[tuple[str, Precision]]
            ) -> tuple[dict[str, Precision], list[str]]:
    """unit -> precision for units given as {unit name: its checkpoint layer names}; plus notes for the report
    (fused layers promoted together, user patterns that matched nothing)."""
    out: dict[str, Precision] = {}
    notes = []
    for unit, names in units.items():
        wanted = [precision_of(n, rules) for n in names]
        out[unit] = max(wanted, key=PRECISIONS.index)
        if len(set(wanted)) > 1:
            notes.append(f"{unit}: {dict(zip(names, wanted))} are fused, all kept in {out[unit]}")
    every = [n for names in units.values() for n in names] + [EMBEDDINGS]
    for pattern, _ in rules[len(DEFAULT_RULES):]:
        if not any(matches(n, pattern) for n in every):
            notes.append(f"policy pattern {pattern!r} matches no layer")
    return out, notes


# ---------------------------------------------------------------- measured sensitivity
@dataclass(slots=True)
class Sensitivity:
    """One linear unit's measured NVFP4 error on the calibration text."""
    unit: str
    segments: tuple[int, ...]     # rows of each checkpoint layer in the unit
    in_features: int
    block_error: float            # relative error of its block's output (attention / MLP) with only it in NVFP4
    layer_error: float            # relative error of its own output
    input_amax: float             # max |x| seen: the static input_global_scale of a W4A4 checkpoint

    @property
    def params(self) -> int:
        return sum(self.segments) * self.in_features

    def extra_bytes(self, keep: Precision, act_quant: bool = False) -> int:
        return sum(bytes_per_layer(keep, r, self.in_features) - bytes_per_layer("nvfp4", r, self.in_features,
                                                                                 act_quant) for r in self.segments)


def choose(found: dict[str, Sensitivity], headroom: int, keep: Precision = "bf16", act_quant: bool = False
           ) -> set[str]:
    """The units to keep in `keep` precision: largest block error first, each while its extra bytes fit."""
    chosen = set()
    for s in sorted(found.values(), key=lambda s: -s.block_error):
        extra = s.extra_bytes(keep, act_quant)
        if extra <= headroom:
            chosen.add(s.unit)
            headroom -= extra
    return chosen


def sensitivity_table(found: dict[str, Sensitivity], chosen: dict[str, Precision]) -> str:
    """Units by decreasing block error, with the precision each was given."""
    lines = [f"{'layer':<34} {'params':>10} {'block err':>10} {'layer err':>10} {'input amax':>11}  precision"]
    for s in sorted(found.values(), key=lambda s: -s.block_error):
        lines.append(f"{s.unit:<34} {s.params:>10,} {s.block_error:>10.4f} {s.layer_error:>10.4f} "
                     f"{s.input_amax:>11.3g}  {chosen[s.unit]}")
    return "\n".join(lines)
