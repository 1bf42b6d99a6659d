"""Tiny GGUF files for tests: a transformers model written as llama.cpp's converter would write it.

Tensor names come from the `gguf` package's own name map. What the converter changes is changed here too: Llama's
q/k rows are permuted for llama.cpp's RoPE, Llama 3's RoPE scaling becomes a `rope_freqs` tensor of per-frequency
divisors (taken from transformers' own llama3 frequencies), Phi-3's LongRoPE factors become `rope_factors_long` and
`rope_factors_short` tensors with the original window and attention factor in the metadata (and its rotated dims
are `rope.dimension_count`, with no key length), Gemma's (1 + w) norm weights are stored with the 1 added, and an
MoE layer's experts are stacked into one [E, I, D] tensor per projection (as transformers keeps them in memory).
Weights are fp32; there is no tokenizer.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows -> llama.cpp's interleaved pairs, per head (what its converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, arch: str, path: str | Path,
               extra_tensors: dict[str, np.ndarray] | None = None,
               quant: Callable[[str], Any] | None = None) -> None:
    """Writes `model` as a GGUF file; `quant` maps a 2-D weight's Hugging Face module name (model.layers.0.mlp.
    up_proj; an expert stack's model.layers.0.mlp.experts.up_proj) to the GGML type it is stored in (quantised
    with gguf's own Q4_0 / Q4_1 / Q8_0), or None for fp32."""
    import gguf
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    rope = _write_metadata(w, c, arch)
    _write_weights(w, model, arch, quant)
    _write_rope_tensors(w, c, arch, rope)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_metadata(w, c, arch: str) -> dict:
    """The config's fields as llama.cpp's converter writes them -> the RoPE parameters of full attention."""
    import gguf
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = c.head_dim if getattr(c, "head_dim", None) else c.hidden_size // c.num_attention_heads
    if arch == "phi3":                      # llama.cpp's converter: the rotated dims, no key length
        w.add_rope_dimension_count(int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)))
    else:
        w.add_key_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)     # Gemma 3: per layer kind
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma3":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(c.eos_token_id)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":                    # (Gemma 3 has no soft caps)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if getattr(c, "num_experts", None):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    return rope


def _write_weights(w, model: torch.nn.Module, arch: str, quant: Callable[[str], Any] | None) -> None:
    """The state dict under llama.cpp's names and conventions (Gemma's norms + 1, Llama's permuted q / k rows)."""
    import gguf
    c = model.config
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.num_hidden_layers)
    for name, t in model.state_dict().items():
        base, kind = name.rsplit(".", 1)
        if base.endswith("mlp.experts"):    # transformers' own stacks: [E, 2I, D] gate then up, [E, D, I] down
            layer = base.split(".")[2]
            parts = t.chunk(2, dim=1) if kind == "gate_up_proj" else (t,)
            for proj, part in zip(("gate_proj", "up_proj") if kind == "gate_up_proj" else (kind,), parts):
                qt = quant(f"{base}.{proj}") if quant is not None else None
                data = part.float().contiguous().numpy()
                if qt is not None:
                    w.add_tensor(f"blk.{layer}.{_STACKED[proj]}.weight", gguf.quants.quantize(data, qt), raw_dtype=qt)
                    continue
                w.add_tensor(f"blk.{layer}.{_STACKED[proj]}.weight", data)
            continue
        if names.get_name(base) is None:    # a tied lm_head (Gemma): the file has the embedding only
            assert c.tie_word_embeddings, f"{base} has no GGUF name"
            continue
        if arch.startswith("gemma") and base.endswith("norm"):
            t = t + 1
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = c.num_attention_heads if base.endswith("q_proj") else c.num_key_value_heads
            t = _permute(t, heads)
        qt = quant(base) if quant is not None and t.ndim == 2 and kind == "weight" else None
        if qt is not None:
            w.add_tensor(f"{names.get_name(base)}.{kind}", gguf.quants.quantize(t.float().numpy(), qt), raw_dtype=qt)
            continue
        w.add_tensor(f"{names.get_name(base)}.{kind}", t.float().numpy())


def _write_rope_tensors(w, c, arch: str, rope: dict) -> None:
    """RoPE scaling that llama.cpp keeps as tensors: Llama 3's frequency divisors, Phi-3's LongRoPE factors."""
    if arch == "llama" and rope.get("rope_type") == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        dim = c.head_dim if getattr(c, "head_dim", None) else c.hidden_size // c.num_attention_heads
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        w.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    if arch == "phi3" and rope.get("rope_type") == "longrope":   # the 128k variants: factors as tensors
        import math
        old = c.original_max_position_embeddings
        scale = c.max_position_embeddings / old
        w.add_rope_scaling_orig_ctx_len(old)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old)) if scale > 1 else 1.0)
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
