"""GGUF quant types served as they are stored (shared/quant/gguf_packing.py, shared/ops/qgemm.py) against
transformers running the file's dequantised weights in fp32: teacher-forced logits within 1e-4, greedy tokens
equal, in fp32 and through the bf16 decoder stack; the default model's packed layers against its dequantised ones."""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.ops import qgemm
from shared.quant.quant_linear import QuantLinear
from shared.sampling_params import SamplingParams
from shared.testing.gguf_files import write_gguf
from shared.testing.moe_checkpoints import COMMON, PROMPTS, hf_greedy

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="needs AVX512-BF16 and a C compiler")

# q, k and v of one fused layer in three types: the layer widens them to one 8-bit form
TYPES = {"q_proj": T.Q4_0, "k_proj": T.Q4_1, "v_proj": T.Q8_0, "o_proj": T.Q4_1, "gate_proj": T.Q4_0,
         "up_proj": T.Q4_0, "down_proj": T.Q8_0}


def quant_type(name: str):
    return TYPES.get(name.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer Llama written as a GGUF file with quantised linears, and transformers' model holding the file's
    dequantised weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=128)).eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(8)                              # spread the logits so greedy ties are unlikely
    path = tmp_path_factory.mktemp("gguf") / "tiny-q.gguf"
    write_gguf(ref, "llama", path, quant=quant_type)
    with torch.no_grad():                                       # what the file holds, as transformers runs it
        for name, p in ref.named_parameters():
            qt = quant_type(name.removesuffix(".weight"))
            if qt is not None:
                p.copy_(torch.from_numpy(dequantize(quantize(p.detach().numpy(), qt), qt)).view_as(p))
    return str(path), ref


def test_packed_layers_match_transformers_in_fp32(tiny):
    path, ref = tiny
    eng = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64))
    layers = eng.runner.model.layers
    assert all(isinstance(m, QuantLinear) for layer in layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert layers[0].self_attn.qkv_proj.packed.kind == 8        # Q4_0 / Q4_1 / Q8_0 fused: 8-bit codes
    assert layers[0].mlp.gate_up_proj.packed.kind == 5          # Q4_0 only: nibbles in place
    ids = torch.randint(1, 110, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    assert (eng.score(ids) - expect).abs().max().item() < 1e-4
    out = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o[0] for o in out] == hf_greedy(ref, PROMPTS, 24)


def test_packed_layers_in_bf16_take_the_decoder_stack(tiny):
    path, ref = tiny
    eng = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64, dtype="bfloat16"))
    ids = torch.randint(1, 110, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    out = eng.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    model = eng.runner.model
    from shared.ops import decoder_bf16
    assert (model._stack[1] is not None) == decoder_bf16.available()    # quantised layers join the C stack
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    got = eng.score(ids)
    assert (got - expect).abs().max().item() < 0.05 * expect.abs().max().item()   # bf16 activations
    assert len(out[0][0]) == 8


def test_the_default_model_packed_equals_its_dequantised_layers(engine, model_path):
    """The default model (Q4_1 layers) in fp32: packed layers against the same file dequantised, within 1e-4."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "data" / "english.txt").read_text()
    from shared.tokenizer import Tokenizer
    ids = Tokenizer(model_path).encode(text)[:120]
    assert isinstance(engine.runner.model.layers[0].mlp.down_proj, QuantLinear)
    plain = LLMEngine(EngineConfig(progress=False, kv_cache_gb=0.1, dequantise_gguf=True))
    assert not isinstance(plain.runner.model.layers[0].mlp.down_proj, QuantLinear)
    diff = (engine.score(ids) - plain.score(ids)).abs().max().item()
    print(f"packed against dequantised: max abs logit difference {diff:.2e}")
    assert diff < 1e-4


def test_the_default_model_holds_its_layers_packed(engine):
    """The process keeps the file's codes, not a dequantised copy: every linear layer and the tied head are
    QuantLinear (0.625 bytes a weight for Q4_1, 1.0625 for the Q8_0 head), and the only dense tensors left are the
    embedding (for lookups) and the norms."""
    model = engine.runner.model
    cfg = engine.model_cfg
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * cfg.num_layers + 1 and isinstance(model.lm_head, QuantLinear)
    weights = sum(m.in_features * m.out_features for m in linears)
    packed = sum(m.packed_nbytes for m in linears)
    head = cfg.vocab_size * cfg.hidden_size
    assert packed == int((weights - head) * 0.625 + head * 1.0625)
    dense = {n: p.numel() for n, p in model.named_parameters()}
    assert sum(dense.values()) == head + cfg.hidden_size * (2 * cfg.num_layers + 1)   # embedding and norms


def test_layers_of_other_quant_types_are_dequantised_and_said(tmp_path, caplog):
    """A type the kernel does not read (Q5_0 here) loads dequantised, the log naming it; the rest stays packed."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=128)).eval()
    path = tmp_path / "mixed.gguf"
    write_gguf(ref, "llama", path, quant=lambda n: T.Q5_0 if n.endswith("down_proj") else quant_type(n))
    with caplog.at_level(logging.INFO, logger="shared.quant.gguf_packing"):
        eng = LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64))
    layer = eng.runner.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear) and not isinstance(layer.mlp.down_proj, QuantLinear)
    assert "['Q5_0'] are dequantised at load" in caplog.text
