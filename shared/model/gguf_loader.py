"""Reading a GGUF file as a checkpoint: its metadata -> ModelConfig, its tensors -> Hugging Face-named tensors
(dequantised to fp32, or the packed blocks as stored for the layers the caller serves packed).

llama.cpp's names and conventions are undone here: tensor names, Llama's permuted q / k rows, Gemma's (1 + w) norm
weights, RoPE scaling kept as tensors, and each family's fields that the file keeps in its metadata.
"""
from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from shared.model.config import ModelConfig
from shared.model_files import file_version

if TYPE_CHECKING:
    from shared.model.gguf_index import GGUFIndex

Weights = Iterator[tuple[str, torch.Tensor]]

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj", "ffn_gate_inp": "mlp.gate",
}
# an MoE layer's experts, stacked [E, out, in] in one tensor per projection
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_ARCH_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},                              # Phi-3 keeps gate and up in one tensor
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_GGUF_ARCH_NAMES["gemma3_text"] = _GGUF_ARCH_NAMES["gemma2"]
# llama.cpp's converter stores Gemma's (1 + w) norm weights with the 1 added: subtract it again
_GGUF_NORM_OFFSET = {"gemma2": 1.0, "gemma3_text": 1.0}
# Architectures read from GGUF (llama.cpp's names), and whether their q / k rows were permuted for llama.cpp's RoPE
# (its converter does so for Llama only).
_GGUF_ARCHS = {"llama": True, "qwen2": False, "qwen3": False, "phi3": False, "gemma2": False, "gemma3": False,
               "olmoe": False}
_GGUF_ARCH_AS = {"gemma3": "gemma3_text"}                      # llama.cpp's name -> shared.model.registry's


def _gguf_field(reader: GGUFIndex, key: str, default=None):
    return reader.get(key, default)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFIndex:
    """The file's metadata and tensor directory (shared.model.gguf_index), shared by the config and the weights of
    one start-up; `gguf_weights` drops it once the weights are read (it maps the file)."""
    from shared.model.gguf_index import GGUFIndex

    return GGUFIndex(path)


def gguf_config(path: str) -> ModelConfig:
    """The file's config (a copy: callers may change theirs)."""
    return copy.deepcopy(_parsed_config(*file_version(path)))


@functools.lru_cache(maxsize=4)
def _parsed_config(path: str, mtime_ns: int, size: int) -> ModelConfig:
    r = _reader(path, mtime_ns, size)
    arch = _gguf_field(r, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; GGUF files of {', '.join(_GGUF_ARCHS)} "
                         "are (other families load from Hugging Face folders)")
    p = f"{arch}."
    heads = _gguf_field(r, p + "attention.head_count")
    hidden = _gguf_field(r, p + "embedding_length")
    rope_dims = _gguf_field(r, p + "rope.dimension_count")
    # Phi-3's files give the rotated dims (Phi-4-mini: 3/4 of a head), not the head dim
    head_dim = _gguf_field(r, p + "attention.key_length") or (hidden // heads if arch == "phi3" else
                                                                 rope_dims or hidden // heads)
    scaling = None
    kind = _gguf_field(r, p + "rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": _gguf_field(r, p + "rope.scaling.factor"),
                   "original_max_position_embeddings": _gguf_field(r, p + "rope.scaling.original_context_length")}
    has_output = any(t.name == "output.weight" for t in r.tensors)
    freqs = next((t for t in r.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:                    # Llama 3.x: llama.cpp writes its scaling as per-frequency divisors
        from gguf.quants import dequantize
        scaling = {"rope_type": "freq_factors",
                   "factors": dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1).tolist()}
    extra, scaling = _family_fields(r, arch, hidden // heads, head_dim, scaling)
    eos = _gguf_field(r, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_GGUF_ARCH_AS.get(arch, arch),
        vocab_size=_gguf_field(r, p + "vocab_size") or len(r.fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=_gguf_field(r, p + "feed_forward_length"),
        num_layers=_gguf_field(r, p + "block_count"),
        num_heads=heads,
        num_kv_heads=_gguf_field(r, p + "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(_gguf_field(r, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_gguf_field(r, p + "rope.freq_base", 10000.0)),
        max_position_embeddings=_gguf_field(r, p + "context_length", 2048),
        tie_word_embeddings=not has_output,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        name=_gguf_field(r, "general.name", os.path.basename(path)),
        extra=extra,
    )


def _family_fields(r, arch: str, width: int, head_dim: int, scaling: dict | None) -> tuple[dict, dict | None]:
    """The family's own config fields (ModelConfig.extra) that a GGUF file keeps in its metadata or implies as
    llama.cpp reads it, and the RoPE scaling left for ModelConfig (Gemma 3 keeps its own per layer kind).
    width: hidden / heads."""
    p = f"{arch}."
    extra: dict = {}
    blocks = _gguf_field(r, p + "block_count")
    if arch == "phi3":                       # its window applies on every layer (shared.model.llama.layer_windows)
        extra["sliding_window"] = _gguf_field(r, p + "attention.sliding_window")
        rope_dims = _gguf_field(r, p + "rope.dimension_count")
        if rope_dims and rope_dims != head_dim:                    # Phi-4-mini: a partial rotary factor
            extra["partial_rotary_factor"] = rope_dims / head_dim
        factors = {t.name: t for t in r.tensors if t.name.startswith("rope_factors_")}
        if factors:                          # the 128k variants: LongRoPE, its factors as tensors
            from gguf.quants import dequantize
            if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
                raise ValueError(f"phi3 GGUF: LongRoPE needs rope_factors_long and rope_factors_short, the file has "
                                 f"{sorted(factors)}")
            read = {n.split("_")[2].split(".")[0]: dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
                    .tolist() for n, t in factors.items()}
            scaling = {"rope_type": "longrope", "long_factor": read["long"], "short_factor": read["short"],
                       "original_max_position_embeddings": _gguf_field(r, p + "rope.scaling.original_context_length"),
                       "max_position_embeddings": _gguf_field(r, p + "context_length"),
                       "attention_factor": _gguf_field(r, p + "rope.scaling.attn_factor")}
    if arch in ("gemma2", "gemma3"):
        # not in the file: llama.cpp scales scores by the head dim, by hidden / heads for the 27B models
        extra.update(sliding_window=_gguf_field(r, p + "attention.sliding_window"),
                     query_pre_attn_scalar=width if blocks == {"gemma2": 46, "gemma3": 62}[arch] else head_dim)
    if arch == "gemma2":                     # local and global layers alternate, the first one local
        extra.update(layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(blocks)],
                     attn_logit_softcapping=_gguf_field(r, p + "attn_logit_softcapping"),
                     final_logit_softcapping=_gguf_field(r, p + "final_logit_softcapping"))
    if arch == "gemma3":                     # every 6th layer global; local layers on their own RoPE base
        pattern = _gguf_field(r, p + "attention.sliding_window_pattern", 6)
        local = ([bool(x) for x in pattern] if isinstance(pattern, list) else
                 [(i + 1) % pattern != 0 for i in range(blocks)])
        extra["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
        full = {"rope_type": "default", "rope_theta": float(_gguf_field(r, p + "rope.freq_base", 10000.0))}
        if scaling:
            full |= {"rope_type": scaling["rope_type"], "factor": scaling["factor"]}
        extra["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(_gguf_field(r, p + "rope.freq_base_swa", 10000.0))}}
        scaling = None
    if arch == "olmoe":                      # softmax top-k, not renormalised (llama.cpp's OLMoE graph)
        extra.update(num_experts=_gguf_field(r, p + "expert_count"),
                     num_experts_per_tok=_gguf_field(r, p + "expert_used_count"), norm_topk_prob=False)
    return extra, scaling


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its RoPE; restore Hugging Face's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(parts: list[str], names: dict[str, str]) -> str:
    """A GGUF tensor's name, split at dots -> its Hugging Face name."""
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


def gguf_quant_types(path: str, cfg: ModelConfig) -> dict[str, Any]:
    """A GGUF file's 2-D weights by Hugging Face name -> their GGML type (the file's directory only)."""
    r = _reader(*file_version(path))
    names = _GGUF_NAMES | _GGUF_ARCH_NAMES.get(cfg.architecture, {})
    out = {}
    for t in r.tensors:
        parts = t.name.split(".")
        if len(t.shape) == 2 and (parts[0] in names or (parts[0] == "blk" and parts[2] in names)):
            out[_hf_name(parts, names)] = t.tensor_type
        elif len(t.shape) == 3 and parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:      # [E, out, in] stacks
            out.update({name: t.tensor_type for name in _expert_names(parts, t.shape[-1])})
    return out


def _expert_names(parts: list[str], count: int) -> list[str]:
    """An MoE layer's stacked expert tensor (blk.L.ffn_up_exps.weight) -> each expert's Hugging Face name."""
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{_GGUF_EXPERTS[parts[2]]}.weight" for e in range(count)]


def gguf_weights(path: str, cfg: ModelConfig, progress: bool, keep: Callable[[str], bool] | None = None,
                 raw: Callable[[str], bool] | None = None) -> Weights:
    from gguf.quants import dequantize

    from shared.quant.gguf_blocks import PACKED_TYPES, GGUFRaw

    r = _reader(*file_version(path))
    permuted = _GGUF_ARCHS.get(cfg.architecture, False)
    names = _GGUF_NAMES | _GGUF_ARCH_NAMES.get(cfg.architecture, {})
    try:
        for t in tqdm(r.tensors, desc="Dequantising GGUF", disable=not progress, unit="tensor"):
            parts = t.name.split(".")
            if parts[0] in ("rope_freqs", "rope_factors_long", "rope_factors_short"):   # read into the config's
                continue                                                               # RoPE scaling
            if parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
                experts = _expert_names(parts, t.shape[-1])
                if keep is not None and not any(map(keep, experts)):
                    continue
                if raw is not None and t.tensor_type in PACKED_TYPES and all(map(raw, experts)):
                    for e, name in enumerate(experts):                  # each expert's rows of blocks, as stored
                        if keep is None or keep(name):
                            yield name, GGUFRaw(t.data[e], t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
                    continue
                stacked = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)     # [E, out, in]
                for e, name in enumerate(experts):
                    if keep is None or keep(name):
                        yield name, torch.from_numpy(np.array(stacked[e], dtype=np.float32))
                continue
            name = _hf_name(parts, names)
            if keep is not None and not keep(name):
                continue
            if raw is not None and t.tensor_type in PACKED_TYPES and len(t.shape) == 2 and raw(name):
                rows = t.data
                if permuted and parts[-2] in ("attn_q", "attn_k"):     # whole rows of blocks move
                    rows = _unpermute(rows, cfg.num_heads if parts[-2] == "attn_q" else cfg.num_kv_heads)
                yield name, GGUFRaw(rows, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
                continue
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            if w.ndim == 1:
                w = w.reshape(-1)
            if parts[-1] == "weight" and parts[-2].endswith("norm") and cfg.architecture in _GGUF_NORM_OFFSET:
                w = w - _GGUF_NORM_OFFSET[cfg.architecture]
            if permuted and parts[-2:-1] == ["attn_q"]:
                w = _unpermute(w, cfg.num_heads)
            elif permuted and parts[-2:-1] == ["attn_k"]:
                w = _unpermute(w, cfg.num_kv_heads)
            yield name, torch.from_numpy(np.array(w, dtype=np.float32))   # writable copy
    finally:
        _reader.cache_clear()                                   # the weights are read: free the parse
