"""`--int8-activations` (shared/ops/qgemm_i8.py) through the engine: a GGUF file's quantised layers on int8
activations against transformers running the file's dequantised weights with each quantised linear's input
quantised by the same rule (forward pre-hooks), in fp32 and through the bf16 decoder stack; greedy speculative
output equal to plain output on the same path."""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.ops import qgemm_i8
from shared.quant.quant_linear import QuantLinear
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine
from shared.testing.gguf_files import write_gguf
from shared.testing.moe_checkpoints import COMMON

pytestmark = pytest.mark.skipif(not qgemm_i8.available(), reason="needs AVX512-VNNI, AVX512-BF16 and a C compiler")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def file_type(name: str):
    short = name.rsplit(".", 1)[-1]
    return None if short not in LINEARS else T.Q8_0 if short == "down_proj" else T.Q4_1


def quantised_input(module, args):
    """The kernel's rule on the layer's input: bf16, then int8 per block of 32 with step amax / 127."""
    x = args[0]
    rows = x.reshape(-1, x.shape[-1])
    q, step = qgemm_i8.quantise_activations(rows.bfloat16(), 32)
    xq = (q.view(rows.shape[0], -1, 32) * step.unsqueeze(-1)).view_as(rows)
    return (xq.view_as(x).to(x.dtype),)


@pytest.fixture(scope="module")
def w4a8(tmp_path_factory):
    """A 3-layer Llama as a Q4_1 / Q8_0 GGUF file, and transformers' model of the file's weights quantising each
    quantised linear's input as the kernel does."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    ref = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=128)).eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(8)
    path = tmp_path_factory.mktemp("gguf") / "tiny-w4a8.gguf"
    write_gguf(ref, "llama", path, quant=file_type)
    with torch.no_grad():
        for name, module in ref.named_modules():
            qt = file_type(name)
            if qt is not None:
                w = module.weight
                w.copy_(torch.from_numpy(dequantize(quantize(w.numpy(), qt), qt)).view_as(w))
                module.register_forward_pre_hook(quantised_input)
    return str(path), ref


def test_int8_activations_match_the_w4a8_reference_in_fp32(w4a8):
    path, ref = w4a8
    eng = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64, int8_activations=True))
    layer = eng.runner.model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and isinstance(layer.mlp.down_proj.packed, qgemm_i8.QWeightI8)
    assert "int8 activations" in repr(eng.runner.model)
    ids = torch.randint(1, 110, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    got = eng.score(ids)
    err = (got - expect).abs().max().item() / expect.abs().max().item()
    exact = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64)).score(ids)
    off = (exact - expect).abs().max().item() / expect.abs().max().item()
    print(f"int8 activations against the W4A8 reference: {err:.1e}; the exact path against it: {off:.1e}")
    assert err < 1e-4 and off > 100 * err


def test_int8_activations_through_the_bf16_decoder_stack(w4a8):
    path, ref = w4a8
    eng = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64, dtype="bfloat16",
                                 int8_activations=True))
    ids = torch.randint(1, 110, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    out = eng.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    from shared.ops import decoder_bf16
    assert (eng.runner.model._stack[1] is not None) == decoder_bf16.available()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    assert (eng.score(ids) - expect).abs().max().item() < 0.05 * expect.abs().max().item()
    assert len(out[0][0]) == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_equals_plain_on_int8_activations(w4a8, dtype):
    """Verification rows go through the same kernel as decode rows, each row's bits independent of the others."""
    path, _ = w4a8
    prompts = [[5, 17, 29, 3, 77, 41, 8, 60, 12, 99] * 3, [9, 2, 64, 13, 9, 2, 64, 13]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = {"model": path, "progress": False, "num_kv_blocks": 64, "dtype": dtype, "int8_activations": True}
    plain = LLMEngine(EngineConfig(**common)).generate(prompts, params)
    spec_engine = build_engine(EngineConfig(**common, speculative="ngram", num_speculative_tokens=4))
    spec = spec_engine.generate(prompts, params)
    assert [o[0] for o in spec] == [o[0] for o in plain]


def test_a_model_without_quantised_layers_refuses_int8_activations(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    path = tmp_path / "dense.gguf"
    write_gguf(LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=128)).eval(), "llama", path)
    with pytest.raises(ValueError, match="int8 activations need block-quantised layers"):
        LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=16, int8_activations=True))
