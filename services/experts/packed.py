"""A shard's FFN linears from checkpoint tensors in any precision a quantised checkpoint mixes: NVFP4 (the
compressed-tensors leaves weight_packed / weight_scale / weight_global_scale [/ input_global_scale]), FP8 E4M3 per
row (weight fp8 + weight_scale), a GGUF quant type's codes and scales (a BlockQuant as `weight`, where the kernel of
shared.ops.qgemm runs) or float (weight). Quantised linears stay packed in memory, as the target's own
NVFP4Linear / FP8Linear / QuantLinear (the same modules, hence the same numerics: W4A16, or W4A4 with act_quant).

Dense FFNs are cut by intermediate neurons (shared.model.placement.dense_slice): gate / up keep rows [lo, hi), down
keeps columns [lo, hi). NVFP4 packs two values per byte and scales blocks of 16 along K, so a down slice of an NVFP4
layer must start and end on a block: lo and hi multiples of 16.

Shapes: i = the unit's intermediate width, D = hidden, K = in features, B = K // 16.
"""
from __future__ import annotations

import torch
from torch import nn

from shared.ops.block_quant import BlockQuant
from shared.quant.checkpoint import load_compressed_tensors
from shared.quant.nvfp4 import BLOCK_SIZE
from shared.quant.nvfp4_module import FP8_DTYPE, FP8Linear, NVFP4Linear
from shared.quant.quant_linear import QuantLinear

LEAVES = ("weight", "bias", "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
Leaves = dict[str, torch.Tensor | BlockQuant]    # one checkpoint layer's tensors, by leaf name


def is_quantised(leaves: Leaves) -> bool:
    w = leaves.get("weight")
    return "weight_packed" in leaves or isinstance(w, BlockQuant) or (w is not None and w.dtype == FP8_DTYPE)


def ffn_width(part: str, leaf: str, t: torch.Tensor | BlockQuant) -> int:
    """The FFN width I that a dense layer's leaf spans (meaningful for the leaves that get sliced)."""
    if isinstance(t, BlockQuant):
        return t.shape[0] if part != "down" else t.shape[1]
    if part != "down":
        return t.shape[0]                                                   # gate / up: rows
    if leaf == "weight_packed":
        return 2 * t.shape[1]
    if leaf == "weight_scale" and t.dtype != torch.float32:
        return BLOCK_SIZE * t.shape[1]
    return t.shape[-1]


def slice_rows(leaf: str, t: torch.Tensor | BlockQuant, lo: int, hi: int) -> torch.Tensor | BlockQuant:
    """Rows [lo, hi) of a gate / up layer's leaf (a copy): every per-row tensor is cut, per-tensor scales kept."""
    if isinstance(t, BlockQuant):
        return t.rows(lo, hi)
    return t.clone() if leaf in ("weight_global_scale", "input_global_scale") else t[lo:hi].clone()


def slice_columns(leaf: str, t: torch.Tensor | BlockQuant, lo: int, hi: int) -> torch.Tensor | BlockQuant:
    """Input features [lo, hi) of a down layer's leaf, a copy (its bias is not sliced; the caller keeps it on
    slice 0)."""
    if isinstance(t, BlockQuant):
        return t.columns(lo, hi)
    return _columns(leaf, t, lo, hi).clone()


def _columns(leaf: str, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    if leaf == "weight":
        return t[:, lo:hi]                                                  # float or fp8 [D, i]
    if leaf == "weight_packed" or (leaf == "weight_scale" and t.dtype != torch.float32):
        per = 2 if leaf == "weight_packed" else BLOCK_SIZE                  # values per byte / per block scale
        if lo % BLOCK_SIZE or hi % BLOCK_SIZE:
            raise ValueError(f"an NVFP4 down_proj can only be split on blocks of {BLOCK_SIZE} input features, "
                             f"not [{lo}, {hi}); use a shard count that divides the FFN width in multiples of 16")
        return t[:, lo // per:hi // per]                                    # [D, i/2] codes or [D, i/16] scales
    return t                                     # FP8 per-row scale [D, 1], global scales, bias


def fused_linear(parts: list[Leaves], act_quant: bool, name: str, int8: bool = False) -> torch.Tensor | nn.Module:
    """Checkpoint layers stacked along N (gate then up, or down alone) -> a float weight [N, K] or a packed module.
    The layers of one fused unit share their precision (`upesi quantize` promotes them together). int8: GGUF and
    NVFP4 layers on int8 activations (shared.ops.qgemm_i8), as the targets' with --int8-activations."""
    kinds = {"nvfp4" if "weight_packed" in p else "gguf" if isinstance(p.get("weight"), BlockQuant)
             else "fp8" if is_quantised(p) else "float" for p in parts}
    if len(kinds) > 1:
        raise ValueError(f"{name}: fused layers in different precisions {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "gguf":
        module = QuantLinear(parts[0]["weight"].shape[1], [p["weight"].shape[0] for p in parts])
        module.int8_activations = int8
        for i, p in enumerate(parts):
            module.load_segment(i, p["weight"], name)
        return module
    if kind == "float":
        return torch.cat([p["weight"] for p in parts])                      # [N, K]
    if kind == "fp8":
        k = parts[0]["weight"].shape[1]
        module: nn.Module = FP8Linear(k, [p["weight"].shape[0] for p in parts])
        for i, p in enumerate(parts):
            scale = p["weight_scale"].float()
            module.load_segment(i, p["weight"], scale.expand(p["weight"].shape[0], 1) if scale.numel() == 1
                                else scale, name)
        return module
    ws = [load_compressed_tensors(p, "") for p in parts]
    module = NVFP4Linear(ws[0].in_features, [w.out_features for w in ws], act_quant=act_quant,
                         input_scales=ws[0].input_global_scale is not None)
    module.int8_activations = int8
    for i, w in enumerate(ws):
        module.load_segment(i, w, name)
    return module


def nbytes(w: torch.Tensor | nn.Module | None) -> int:
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    own = getattr(w, "packed_nbytes", 0)                    # a PackedLinear's opaque oneDNN copy
    return own + sum(t.numel() * t.element_size() for t in (*w.parameters(), *w.buffers()))


def move(w: torch.Tensor | nn.Module | None, device: torch.device, dtype: torch.dtype):
    """Float tensors take the shard's dtype; packed modules keep their storage format, moving device only."""
    if w is None:
        return None
    return w.to(device, dtype) if isinstance(w, torch.Tensor) else w.to(device)
