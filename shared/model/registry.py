"""Architectures by name: one entry per model family, no if-ladder."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.deepseek_v3 import DeepseekV3ForCausalLM
from shared.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from shared.model.llama import LlamaForCausalLM, MistralForCausalLM
from shared.model.gguf_loader import gguf_quant_types
from shared.model.loader import iter_weights, load_config, read_hf_config
from shared.model.mixtral import MixtralForCausalLM
from shared.model.olmoe import OlmoeForCausalLM
from shared.model.phi3 import Phi3ForCausalLM
from shared.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from shared.model.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from shared.model_files import is_gguf
from shared.ops.packed_linear import pack_linears
from shared.ops.rope import rope_tables
from shared.quant.gguf_packing import pack_gguf_linears
from shared.quant.model_quant import apply_quantization, set_int8_activations

ARCHITECTURES: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "smollm": LlamaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def check_architecture(path: str) -> None:
    """Refuses a checkpoint of a family this code does not serve, naming the ones it does, before its config is
    parsed (another family's config.json may lack the fields a decoder config needs)."""
    if is_gguf(path):
        arch = load_config(path).architecture
    else:
        arch = read_hf_config(path).get("model_type", "llama")
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; the supported families are "
                         f"{', '.join(sorted(ARCHITECTURES))}")


def build_model(path: str, max_len: int, dtype: torch.dtype, device: torch.device | str,
                progress: bool = True, overrides: dict[str, Any] | None = None,
                packed: bool = True, int8_activations: bool = False) -> tuple[nn.Module, ModelConfig]:
    """Builds the registered architecture for the checkpoint at `path` (its config with `overrides`,
    shared.model.loader.load_config) and loads its weights. packed=False dequantises a GGUF file's quantised
    layers to `dtype` instead of keeping them packed (shared.quant.gguf_packing); int8_activations runs the
    block-quantised layers on int8 activations (shared.ops.qgemm_i8; raises ValueError where none would)."""
    check_architecture(path)
    cfg = load_config(path, overrides)
    factory = ARCHITECTURES[cfg.architecture]
    with torch.device("meta"):
        model = factory(cfg, max_len)
    consume = apply_quantization(model, cfg.extra, path)   # quantised checkpoints: swap layers, take their tensors
    if is_gguf(path) and packed and torch.device(device).type == "cpu":   # GGUF quant types stay packed (CPU)
        consume = pack_gguf_linears(model, gguf_quant_types(path, cfg), tied_head=cfg.tie_word_embeddings)
    if int8_activations and not set_int8_activations(model):
        raise ValueError("int8 activations need block-quantised layers (a quantised GGUF, an NVFP4 checkpoint) and "
                         "a CPU with AVX512-VNNI and AVX512-BF16; this model or machine has neither")
    model = model.to_empty(device="cpu")          # no random init: every weight comes from the checkpoint
    model.rope_cos, model.rope_sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, max_len, cfg.rope_scaling)
    if cfg.tie_word_embeddings and type(model.lm_head) is nn.Linear:     # (a packed head has its own codes)
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(consume(iter_weights(path, cfg, progress, raw=getattr(consume, "raw", None))))
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()   # tables stay fp32
    # bf16 on CPU: weights prepacked for oneDNN (bit-identical, about 2x faster at decode's few rows); the LM head
    # keeps its tensor (tied to the embedding, and read by in-process EAGLE heads); MLA reads kv_b_proj's tensor.
    pack_linears(model, keep_weight=("lm_head",), skip=("kv_b_proj",))
    return model, cfg
