"""The files of a checkpoint folder that `upesi quantize` writes beside its weights: config.json with its
compressed-tensors quantization_config, and the tokenizer and chat template."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from shared.model.config import ModelConfig
from shared.model_files import is_gguf
from shared.quant import policy as pol
from shared.quant.checkpoint import CT_FORMAT, compressed_tensors_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
FP8_GROUP: dict[str, Any] = {  # compressed-tensors' FP8 weight-only scheme: E4M3, one scale per output row
    "targets": [], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                               "dynamic": False},
    "input_activations": None, "output_activations": None, "format": "float-quantized"}


def quantization_config(layers: dict[str, pol.Precision], act_quant: bool) -> dict | None:
    """The compressed-tensors quantization_config describing these layer precisions (None: nothing quantised)."""
    linear = {n: p for n, p in layers.items() if n != pol.EMBEDDINGS}
    nvfp4 = sorted(n for n, p in linear.items() if p == "nvfp4")
    fp8 = sorted(n for n, p in linear.items() if p == "fp8")
    dense = sorted({n for n, p in linear.items() if p in ("bf16", "fp32")} | ({"lm_head"} - set(linear)))
    if not nvfp4 and not fp8:
        return None
    qc = compressed_tensors_config(act_quant, targets=("Linear",) if not fp8 else tuple(nvfp4), ignore=tuple(dense))
    if fp8:
        qc["config_groups"]["group_1"] = {**FP8_GROUP, "targets": fp8}
        if not nvfp4:
            del qc["config_groups"]["group_0"]
        qc["format"] = "mixed-precision" if nvfp4 else "float-quantized"
    else:
        qc["format"] = CT_FORMAT
    return qc


def write_config(src: str, cfg: ModelConfig, out: str, layers: dict[str, pol.Precision], act_quant: bool) -> None:
    """config.json: the source's (synthesised for a GGUF) with the quantization_config of `layers`."""
    if is_gguf(src):
        hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
              "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
              "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias, "bos_token_id": cfg.bos_token_id,
              "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids or None,
              "hidden_act": "silu", "dtype": "bfloat16"}
    else:
        hf = json.loads(Path(src, "config.json").read_text())
        hf["tie_word_embeddings"] = cfg.tie_word_embeddings           # False where the head was quantised apart
    qc = quantization_config(layers, act_quant)
    if qc is not None:
        hf["quantization_config"] = qc
    Path(out, "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def copy_tokenizer(src: str, out: str, tokenizer) -> None:
    """The tokenizer and chat template, so the folder is self-contained (a GGUF's come from its metadata)."""
    if is_gguf(src):                               # the folder the GGUF's tokenizer was converted into
        for name in os.listdir(tokenizer.folder):
            shutil.copy2(os.path.join(tokenizer.folder, name), os.path.join(out, name))
        return
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))
