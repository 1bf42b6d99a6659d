"""Tiny random MoE checkpoints of each family, saved as Hugging Face folders: our loader, routing, experts and (for
DeepSeek-V3) latent attention over the paged cache against transformers, teacher-forced and greedy."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.testing.gguf_files import write_gguf
from shared.testing.moe_checkpoints import PROMPTS, FAMILIES, hf_greedy, save_tiny


def _engine(path):
    return LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, block_size=16))


def _logits_diff(ref, eng, n=120):
    ids = torch.randint(1, 110, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    return ids, (eng.score(ids) - expect).abs().max().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_match_transformers(tmp_path, family):
    ref = save_tiny(tmp_path, family)
    eng = _engine(tmp_path)
    ids, diff = _logits_diff(ref, eng)
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4
    prompts = [ids[:20], ids[40:47]]        # decoded together: batched routing and paged attention
    expect = hf_greedy(ref, prompts)
    out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o[0] for o in out] == expect


def test_deepseek_v3_caches_one_latent_per_token(tmp_path):
    """No q LoRA, non-interleaved RoPE, yarn with mscale: the latent cache is one tensor for K and V."""
    ref = save_tiny(tmp_path, "deepseek_v3_yarn")
    eng = _engine(tmp_path)
    k, v = eng.runner.kv_caches[0]
    assert k is v and tuple(k.shape) == (64, 16, 1, 32 + 8)
    _, diff = _logits_diff(ref, eng)
    print(f"deepseek_v3 (yarn, no q LoRA): max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4


def test_an_olmoe_gguf_file_matches_transformers(tmp_path):
    """OLMoE written as llama.cpp would (64 experts stacked into one tensor per projection and layer, the router as
    ffn_gate_inp, q/k norms over the whole projections), loaded from GGUF and run against the model it came from."""
    ref = save_tiny(tmp_path / "hf", "olmoe")
    path = tmp_path / "olmoe.gguf"
    write_gguf(ref, "olmoe", path)
    eng = _engine(path)
    assert eng.model_cfg.architecture == "olmoe" and eng.model_cfg.extra["num_experts"] == 64
    assert _logits_diff(ref, eng)[1] < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == hf_greedy(ref, PROMPTS, 16)


def test_an_olmoe_nvfp4_checkpoint_matches_the_dequantised_reference(tmp_path):
    """`upesi quantize` on OLMoE (transformers stores its 64 experts fused, [E, 2I, D] and [E, D, I]): each
    expert's gate, up and down projections NVFP4 on their own scales, served in fp32 against transformers on
    weights dequantised here, expert by expert, with shared.quant.nvfp4."""
    from shared.convert.quantize import quantize
    from shared.quant.nvfp4 import quantise_weight
    from shared.quant.nvfp4_module import NVFP4Linear
    src = save_tiny(tmp_path / "src", "olmoe")
    prec = quantize(str(tmp_path / "src"), str(tmp_path / "q"), progress=False).layer_precisions
    c = src.config
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(c.num_hidden_layers)
               for e in range(c.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    assert {prec[name] for name in experts} == {"nvfp4"}
    eng = _engine(tmp_path / "q")
    assert isinstance(eng.runner.model.layers[0].mlp.experts[63].gate_up_proj, NVFP4Linear)

    def dq(w: torch.Tensor) -> torch.Tensor:
        return quantise_weight(w).dequantise()

    state = {k: v.clone() for k, v in src.state_dict().items()}
    for key, w in state.items():
        if key.endswith("experts.gate_up_proj"):                         # [E, 2I, D]: gate rows, then up rows
            state[key] = torch.stack([torch.cat([dq(g), dq(u)]) for g, u in (x.chunk(2) for x in w)])
        elif key.endswith("experts.down_proj"):                          # [E, D, I]
            state[key] = torch.stack([dq(x) for x in w])
        elif prec.get(key.removesuffix(".weight")) == "nvfp4":
            state[key] = dq(w)
        elif prec.get(key.removesuffix(".weight")) == "bf16":
            state[key] = w.bfloat16().float()
    ref = type(src)(c).eval()
    ref.load_state_dict(state)
    ids, diff = _logits_diff(ref, eng)
    print(f"olmoe nvfp4: max |logits - dequantised transformers| = {diff:.2e}")
    assert diff < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == hf_greedy(ref, PROMPTS, 16)


def test_a_quantised_olmoe_gguf_keeps_its_experts_packed(tmp_path):
    """OLMoE's stacked expert tensors in Q4_0 (gate and up; down's 16 inputs are under a block): each expert's
    rows of blocks go straight into its own packed layer (shared/quant/gguf_packing.py), against transformers
    running the file's dequantised experts."""
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from shared.ops import qgemm
    from shared.quant.quant_linear import QuantLinear
    if not qgemm.available():
        pytest.skip("needs the quantised kernel (AVX512-BF16)")
    ref = save_tiny(tmp_path / "hf", "olmoe")
    path = tmp_path / "olmoe-q.gguf"
    write_gguf(ref, "olmoe", path, quant=lambda name: T.Q4_0 if name.endswith(("experts.gate_proj",
                                                                             "experts.up_proj")) else None)
    with torch.no_grad():                                   # [E, 2I, D]: gate rows then up rows, each quantised
        for layer in ref.model.layers:
            stack = layer.mlp.experts.gate_up_proj
            parts = [torch.from_numpy(dequantize(quantize(p.contiguous().numpy(), T.Q4_0), T.Q4_0)).view_as(p)
                     for p in stack.chunk(2, dim=1)]
            stack.copy_(torch.cat(parts, dim=1))
    eng = _engine(path)
    experts = eng.runner.model.layers[0].mlp.experts
    assert all(isinstance(e.gate_up_proj, QuantLinear) for e in experts)
    assert not isinstance(experts[0].down_proj, QuantLinear)
    assert _logits_diff(ref, eng)[1] < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == hf_greedy(ref, PROMPTS, 16)
