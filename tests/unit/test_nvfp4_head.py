"""`upesi quantize --lm-head nvfp4` on a model whose head is tied to its embeddings: the checkpoint unties them
(embeddings bf16 for the lookup, the head NVFP4), the engine serves the head as an NVFP4Linear, and its logits
equal transformers' untied Llama on weights dequantised here with shared.quant.nvfp4."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from shared.convert.quantize import quantize
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.quant.nvfp4 import quantise_weight
from shared.quant.nvfp4_module import NVFP4Linear

IDS = torch.randint(1, 90, (40,), generator=torch.Generator().manual_seed(2)).tolist()


def tied_model(path: Path) -> LlamaForCausalLM:
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=95,
                      bos_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)
    model.save_pretrained(path)
    return model


def untied_reference(src: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every linear and the head NVFP4-dequantised, the embeddings rounded to bf16, the head no longer tied."""
    state = {k: v.clone() for k, v in src.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    for key, w in state.items():
        if key.endswith("proj.weight"):
            state[key] = quantise_weight(w).dequantise()
    state["model.embed_tokens.weight"] = embed.bfloat16().float()
    state["lm_head.weight"] = quantise_weight(embed).dequantise()
    model = LlamaForCausalLM(LlamaConfig(**{**src.config.to_dict(), "tie_word_embeddings": False})).eval()
    model.load_state_dict(state)
    return model


def test_a_tied_head_quantised_apart(tmp_path: Path) -> None:
    src = tied_model(tmp_path / "src")
    result = quantize(str(tmp_path / "src"), str(tmp_path / "q"), lm_head="nvfp4", progress=False)
    assert result.unit_precisions["lm_head"] == "nvfp4"
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and "lm_head" not in cfg["quantization_config"]["ignore"]
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert "lm_head.weight_packed" in tensors and tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    eng = LLMEngine(EngineConfig(model=str(tmp_path / "q"), progress=False, num_kv_blocks=32, device="cpu"))
    assert isinstance(eng.runner.model.lm_head, NVFP4Linear)
    with torch.inference_mode():
        expect = untied_reference(src)(torch.tensor([IDS])).logits[0]
    assert (eng.score(IDS) - expect).abs().max().item() < 1e-4 * expect.abs().max().item()


def test_the_head_stays_tied_and_high_precision_by_default(tmp_path: Path) -> None:
    tied_model(tmp_path / "src")
    result = quantize(str(tmp_path / "src"), str(tmp_path / "q"), progress=False)
    assert "lm_head" not in result.unit_precisions
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "lm_head" in cfg["quantization_config"]["ignore"]
