"""Reading checkpoints: a Hugging Face folder (config.json + *.safetensors) or a GGUF file (shared.model.gguf_loader).

Both produce a ModelConfig and an iterator of Hugging Face-named tensors, so every architecture loads
from either.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.model.config import ModelConfig
from shared.model.gguf_loader import gguf_config, gguf_weights
from shared.model_files import ModelNotFound, is_gguf

Weights = Iterator[tuple[str, torch.Tensor]]


# Multimodal checkpoints served for their text: model_type -> the key of their language model's config. Their text
# weights sit under `language_model.` (`model.language_model.` in transformers 5's own naming); the vision tower
# and the projector are not read, so requests are text only.
TEXT_TOWERS = {"gemma3": "text_config"}
_TOWER_NAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def read_hf_config(folder: str) -> dict[str, Any]:
    """A Hugging Face folder's config.json; for a multimodal checkpoint of TEXT_TOWERS its language model's, with
    the wrapper's tie_word_embeddings (the one transformers ties by) and `text_tower_of` naming the wrapper."""
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    key = TEXT_TOWERS.get(hf.get("model_type"))
    if key is None:
        return hf
    return hf[key] | {"tie_word_embeddings": hf.get("tie_word_embeddings", hf[key].get("tie_word_embeddings", True)),
                      "text_tower_of": hf["model_type"]}


def load_config(path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The checkpoint's config, with `overrides` (vLLM's --hf-overrides: config.json keys and their values) put
    over it. A GGUF file has no config.json: there a key names a ModelConfig field (by its name or its Hugging Face
    name, e.g. num_hidden_layers) or else a family field (ModelConfig.extra, e.g. sliding_window)."""
    if is_gguf(path):
        return _override(gguf_config(path), overrides or {})
    cfg = ModelConfig.from_hf(read_hf_config(path) | (overrides or {}), name=os.path.basename(os.path.normpath(path)))
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = list(eos) if isinstance(eos, list) else [eos]
    return cfg


def iter_weights(path: str, cfg: ModelConfig, progress: bool = True,
                 keep: Callable[[str], bool] | None = None, raw: Callable[[str], bool] | None = None) -> Weights:
    """The checkpoint's tensors by their Hugging Face names; with `keep`, only those it accepts, and the others are
    neither read nor dequantised (a draft service wants 3 tensors, an expert shard the FFNs). A GGUF file's
    quantised tensors whose names `raw` accepts come as they are stored (shared.quant.gguf_blocks.GGUFRaw)."""
    if is_gguf(path):
        return gguf_weights(path, cfg, progress, keep, raw)
    if cfg.extra.get("text_tower_of"):
        return (nw for nw in _text_tower(_safetensors_weights(path, progress)) if keep is None or keep(nw[0]))
    return _safetensors_weights(path, progress, keep)


def _text_tower(weights: Weights) -> Weights:
    """A multimodal checkpoint's tensors -> its language model's, named as a text-only checkpoint names them."""
    for name, tensor in weights:
        for old, new in _TOWER_NAMES:
            if name.startswith(old):
                yield new + name[len(old):], tensor
                break


# ---------------------------------------------------------------- Hugging Face folders
def _safetensors_weights(folder: str, progress: bool, keep: Callable[[str], bool] | None = None) -> Weights:
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"no *.safetensors files in {folder}")
    for file in tqdm(files, desc="Loading safetensors", disable=not progress or len(files) < 2):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


_HF_FIELDS = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
              "num_key_value_heads": "num_kv_heads"}


def _override(cfg: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    own = {f.name for f in dataclasses.fields(ModelConfig)} - {"architecture", "name", "extra"}
    for key, value in overrides.items():
        name = _HF_FIELDS.get(key, key)
        if name in own:
            setattr(cfg, name, value)
        else:
            cfg.extra[key] = value
    return cfg
