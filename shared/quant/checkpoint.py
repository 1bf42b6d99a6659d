"""NVFP4 checkpoint layouts: read one linear layer's tensors into an NVFP4Weight, write the compressed-tensors one.

Shapes: N = out features, K = in features, B = K // 16.

    compressed-tensors (config.json quantization_config.format == "nvfp4-pack-quantized"):
        {prefix}.weight_packed       [N, K/2] uint8
        {prefix}.weight_scale        [N, B]   float8_e4m3fn
        {prefix}.weight_global_scale [1]      float32   x_hat = value * weight_scale / weight_global_scale
        {prefix}.input_global_scale  [1]      float32   (W4A4 only)
    NVIDIA ModelOpt (quant_algo "NVFP4", in hf_quant_config.json or config.json):
        {prefix}.weight              [N, K/2] uint8      same codes and nibble order
        {prefix}.weight_scale        [N, B]   float8_e4m3fn
        {prefix}.weight_scale_2      []       float32   = 1 / weight_global_scale
        {prefix}.input_scale         []       float32   = 1 / input_global_scale

ModelOpt's reciprocals are inverted in fp32 on load, exactly as compressed-tensors' ModelOptNvfp4Converter does.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from shared.quant.nvfp4 import BLOCK_SIZE, NVFP4Error, NVFP4Weight, quantise_weight

Layout = Literal["compressed-tensors", "modelopt"]
CT_FORMAT = "nvfp4-pack-quantized"


class CheckpointFormatError(NVFP4Error):
    """A checkpoint's tensors or quantization config are not a layout this module reads."""


def _key(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('.')}.{name}" if prefix else name


def _get(tensors: Mapping[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    key = _key(prefix, name)
    if key not in tensors:
        raise CheckpointFormatError(f"missing tensor {key!r} for an NVFP4 layer")
    return tensors[key]


def _weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
            input_global_scale: torch.Tensor | None, prefix: str) -> NVFP4Weight:
    try:
        return NVFP4Weight(packed, scale, global_scale, input_global_scale)
    except NVFP4Error as e:
        raise CheckpointFormatError(f"layer {prefix!r}: {e}") from e


def load_compressed_tensors(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Weight:
    """One layer of a compressed-tensors nvfp4-pack-quantized checkpoint; tensors may hold other layers too."""
    if _key(prefix, "weight_zero_point") in tensors:
        raise CheckpointFormatError(f"layer {prefix!r} has a weight_zero_point: asymmetric NVFP4 is not supported")
    igs = tensors.get(_key(prefix, "input_global_scale"))
    return _weight(_get(tensors, prefix, "weight_packed"), _get(tensors, prefix, "weight_scale"),
                   _get(tensors, prefix, "weight_global_scale"), igs, prefix)


def load_modelopt(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Weight:
    """One layer of an NVIDIA ModelOpt NVFP4 checkpoint."""
    input_scale = tensors.get(_key(prefix, "input_scale"))
    igs = None if input_scale is None else 1 / input_scale.to(torch.float32)
    weight_scale_2 = _get(tensors, prefix, "weight_scale_2").to(torch.float32)
    return _weight(_get(tensors, prefix, "weight"), _get(tensors, prefix, "weight_scale"), 1 / weight_scale_2,
                   igs, prefix)


LOADERS: dict[Layout, Callable[[Mapping[str, torch.Tensor], str], NVFP4Weight]] = {
    "compressed-tensors": load_compressed_tensors,
    "modelopt": load_modelopt,
}


def load_nvfp4_linear(tensors: Mapping[str, torch.Tensor], prefix: str, layout: Layout) -> NVFP4Weight:
    """The NVFP4Weight of the linear layer `prefix` (e.g. "model.layers.0.mlp.down_proj") in either layout."""
    if layout not in LOADERS:
        raise CheckpointFormatError(f"unknown NVFP4 layout {layout!r}; known: {sorted(LOADERS)}")
    return LOADERS[layout](tensors, prefix)


def _is_ct_nvfp4_group(group: Mapping[str, Any]) -> bool:
    w = group.get("weights") or {}
    return (w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == BLOCK_SIZE
            and w.get("strategy") == "tensor_group")


def detect_layout(config: Mapping[str, Any]) -> Layout | None:
    """Which NVFP4 layout a config describes: config.json (with quantization_config) or hf_quant_config.json.

    None when the checkpoint is not NVFP4. Raises CheckpointFormatError for an NVFP4 config this module cannot read
    (asymmetric weights).
    """
    qc = config.get("quantization_config") or config
    method = qc.get("quant_method")
    modelopt = qc.get("quantization", qc)                                  # hf_quant_config.json nests it
    if method == "modelopt" or (config.get("producer") or {}).get("name") == "modelopt":
        return "modelopt" if str(modelopt.get("quant_algo", "")).upper() == "NVFP4" else None
    if method != "compressed-tensors":
        return None
    groups = [g for g in (qc.get("config_groups") or {}).values() if _is_ct_nvfp4_group(g)]
    if not groups:
        return None
    if any(not g["weights"].get("symmetric", True) for g in groups):
        raise CheckpointFormatError("asymmetric NVFP4 weights are not supported")
    return "compressed-tensors"


def to_compressed_tensors(prefix: str, w: NVFP4Weight | torch.Tensor,
                          input_global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one layer, from an NVFP4Weight or a float [N, K] weight to quantise.

    input_global_scale (448 * 6 / calibrated activation amax, see nvfp4.global_scale_from_amax) is written when
    given here or held by w; a W4A4 config (compressed_tensors_config(act_quant=True)) needs it on every layer.
    """
    if isinstance(w, torch.Tensor):
        w = quantise_weight(w, input_global_scale)
    out = {  # clones: safetensors refuses tensors that share memory (one input scale for many layers, say)
        _key(prefix, "weight_packed"): w.packed.clone(memory_format=torch.contiguous_format),
        _key(prefix, "weight_scale"): w.scale.clone(memory_format=torch.contiguous_format),
        _key(prefix, "weight_global_scale"): w.global_scale.reshape(1).clone(),
    }
    igs = input_global_scale if input_global_scale is not None else w.input_global_scale
    if igs is not None:
        out[_key(prefix, "input_global_scale")] = igs.to(torch.float32).reshape(1).clone()
    return out


def _args(dynamic: bool | str) -> dict[str, Any]:
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": BLOCK_SIZE, "strategy": "tensor_group",
            "dynamic": dynamic, "scale_dtype": "torch.float8_e4m3fn"}


def compressed_tensors_config(act_quant: bool = True, targets: tuple[str, ...] = ("Linear",),
                              ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """The config.json "quantization_config" of an NVFP4 (act_quant) or NVFP4A16 compressed-tensors checkpoint.

    Mirrors compressed-tensors' QuantizationConfig.model_dump() for its NVFP4 / NVFP4A16 presets: activations
    have dynamic local (per-block) scales and a static global scale, stored as input_global_scale.
    """
    inputs = {**_args("local"), "observer": "static_minmax"} if act_quant else None
    return {
        "config_groups": {"group_0": {"targets": list(targets), "weights": _args(False), "input_activations": inputs,
                                      "output_activations": None, "format": CT_FORMAT}},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "sparsity_config": {},
        "transform_config": {},
    }
