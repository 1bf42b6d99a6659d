"""NVFP4 end to end on a tiny random Llama: `quantize` -> compressed-tensors folder -> LLMEngine, checked against an
independent reference (transformers' Llama on weights dequantised here with shared.quant.nvfp4) and against
compressed-tensors' own dequantiser."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from shared.convert.quantize import quantize
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.ops.packed_linear import PackedLinear
from shared.quant.checkpoint import CheckpointFormatError
from shared.quant.model_quant import set_act_quant
from shared.quant.nvfp4 import NVFP4ShapeError, fake_quantise, quantise_weight
from shared.quant.nvfp4_linear import nvfp4_linear
from shared.quant.nvfp4_module import FP8Linear, NVFP4Linear
from shared.quant.policy import PolicyError, parse_size
from shared.sampling_params import SamplingParams

HIGH = (nn.Linear, PackedLinear)       # a layer served in high precision: plain, or prepacked for the CPU kernels

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
LAYERS = [f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS]
IDS = torch.randint(1, 90, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def save_tiny(path: Path, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie, eos_token_id=95,
                      bos_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():                         # spread the logits so greedy ties are unlikely
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    return model


def reference(src: LlamaForCausalLM, precisions: dict[str, str]) -> LlamaForCausalLM:
    """transformers' Llama with each source weight replaced by what its precision keeps of it, computed here."""
    state = {k: v.clone() for k, v in src.state_dict().items()}
    for key, w in state.items():
        p = precisions.get(key.removesuffix(".weight"), "fp32")
        if p == "nvfp4":
            state[key] = quantise_weight(w).dequantise()
        elif p == "fp8":                          # E4M3 with one fp32 scale per row
            scale = w.abs().amax(dim=1, keepdim=True) / 448
            state[key] = (w / scale).to(torch.float8_e4m3fn).float() * scale
        elif p == "bf16":
            state[key] = w.bfloat16().float()
    model = LlamaForCausalLM(src.config).eval()
    model.load_state_dict(state)
    return model


def default_precisions(**override: str) -> dict[str, str]:
    return {**{n: "nvfp4" for n in LAYERS}, "model.embed_tokens": "bf16", "lm_head": "bf16", **override}


def engine(path: Path) -> LLMEngine:
    """fp32 on the CPU, where the reference runs (the CUDA test below checks the GPU path against it)."""
    return LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, device="cpu"))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_quantized_model_matches_dequantised_reference(tmp_path: Path, tie: bool) -> None:
    src = save_tiny(tmp_path / "src", tie)
    result = quantize(str(tmp_path / "src"), str(tmp_path / "q"), progress=False)
    assert {u for u, p in result.unit_precisions.items() if p != "nvfp4"} == (set() if tie else {"lm_head"})
    eng = engine(tmp_path / "q")
    model = eng.runner.model
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.gate_up_proj
    assert isinstance(qkv, NVFP4Linear) and qkv.segments == (64, 32, 32) and gate_up.segments == (96, 96)
    assert type(model.lm_head) in HIGH                           # high precision by default
    ref = reference(src, default_precisions())
    assert (eng.score(IDS) - logits(ref)).abs().max().item() < 1e-5
    with torch.inference_mode():
        expect = ref.generate(torch.tensor([IDS[:20]]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              temperature=None, top_p=None, top_k=None)[0, 20:].tolist()
    assert eng.generate([IDS[:20]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0][0] == expect


def test_checkpoint_loads_in_compressed_tensors_with_identical_weights(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "src", tie=False)
    (tmp_path / "policy.json").write_text(json.dumps({"model.layers.0.mlp.*": "fp8", "*.o_proj": "bf16"}))
    quantize(str(tmp_path / "src"), str(tmp_path / "q"), policy=str(tmp_path / "policy.json"), progress=False)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    QuantizationConfig.model_validate(config["quantization_config"])
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    dense = CompressedTensorsDequantizer(tmp_path / "q", dtype=torch.float32).validate(dict(tensors))
    model = engine(tmp_path / "q").runner.model
    source = src.state_dict()
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for unit in [f"layers.{i}.{n}" for i in range(2) for n in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                "mlp.gate_up_proj", "mlp.down_proj")]:
        module = model.get_submodule(unit)
        prefix, _, short = unit.rpartition(".")
        parts = [f"model.{prefix}.{p}" for p in fused.get(short, [short])]
        theirs = torch.cat([dense[f"{p}.weight"] for p in parts])                 # compressed-tensors' weights
        ours = (module.weight if type(module) in HIGH else module.dequantise()).float()   # what we serve
        if isinstance(module, NVFP4Linear):            # compressed-tensors decompresses NVFP4 to bf16
            ours = ours.bfloat16().float()
            expect = torch.cat([quantise_weight(source[f"{p}.weight"]).dequantise() for p in parts])
            assert torch.equal(ours, expect.bfloat16().float())
        assert torch.equal(ours, theirs.float()), unit
    assert isinstance(model.layers[0].mlp.gate_up_proj, FP8Linear)
    assert isinstance(model.layers[1].mlp.gate_up_proj, NVFP4Linear)
    assert type(model.layers[0].self_attn.o_proj) in HIGH
    assert torch.equal(dense["lm_head.weight"], source["lm_head.weight"].bfloat16().float())


def test_policy_file_keeps_the_chosen_layers_in_high_precision(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "src")
    (tmp_path / "policy.yaml").write_text('"*.mlp.down_proj": bf16\n"model.layers.1.self_attn.q_proj": fp32\n'
                                          '"re:model\\\\.layers\\\\.0\\\\.mlp\\\\.(gate|up)_proj": fp8\n'
                                          '"nothing.*": bf16\n')
    result = quantize(str(tmp_path / "src"), str(tmp_path / "q"), policy=str(tmp_path / "policy.yaml"),
                      progress=False)
    assert result.unit_precisions["layers.1.self_attn.qkv_proj"] == "fp32"      # k, v follow q (fused)
    assert result.unit_precisions["layers.0.mlp.gate_up_proj"] == "fp8"
    assert {result.unit_precisions[f"layers.{i}.mlp.down_proj"] for i in range(2)} == {"bf16"}
    assert any("fused" in n for n in result.notes) and any("'nothing.*' matches no layer" in n for n in result.notes)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.self_attn.k_proj.weight"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.up_proj.weight_packed" in tensors
    eng = engine(tmp_path / "q")
    layers = eng.runner.model.layers
    assert type(layers[0].mlp.down_proj) in HIGH and type(layers[1].self_attn.qkv_proj) in HIGH
    assert isinstance(layers[0].mlp.gate_up_proj, FP8Linear) and isinstance(layers[1].mlp.gate_up_proj, NVFP4Linear)
    precisions = default_precisions(**{f"model.layers.{i}.mlp.down_proj": "bf16" for i in range(2)},
                                    **{f"model.layers.1.self_attn.{p}_proj": "fp32" for p in "qkv"},
                                    **{f"model.layers.0.mlp.{p}_proj": "fp8" for p in ("gate", "up")})
    assert (eng.score(IDS) - logits(reference(src, precisions))).abs().max().item() < 1e-5


def test_auto_policy_keeps_the_most_sensitive_layers_within_the_budget(tmp_path: Path, capsys) -> None:
    save_tiny(tmp_path / "src")
    plain = quantize(str(tmp_path / "src"), str(tmp_path / "plain"), progress=False)
    budget = plain.weight_bytes + 12_000                # room for a few bf16 units (qkv: +11,040 bytes)
    result = quantize(str(tmp_path / "src"), str(tmp_path / "q"), policy="auto", memory_budget=budget,
                      calibration=IDS, progress=False)
    found = result.sensitivity
    assert set(found) == set(result.unit_precisions) and all(s.block_error > 0 for s in found.values())
    headroom, expect = budget - plain.weight_bytes, set()
    for s in sorted(found.values(), key=lambda s: -s.block_error):       # greedy, most sensitive first
        if s.extra_bytes("bf16") <= headroom:
            expect.add(s.unit)
            headroom -= s.extra_bytes("bf16")
    assert expect and {u for u, p in result.unit_precisions.items() if p == "bf16"} == expect
    assert result.weight_bytes <= budget
    print(result.report())
    table = capsys.readouterr().out
    assert "block err" in table and all(u in table for u in found)
    model = engine(tmp_path / "q").runner.model
    assert all(type(model.get_submodule(u)) in HIGH for u in expect)
    with pytest.raises(PolicyError, match="below the all-NVFP4 size"):
        quantize(str(tmp_path / "src"), str(tmp_path / "x"), policy="auto", memory_budget="1KB", calibration=IDS)


def test_w4a4_checkpoint_and_activation_quantisation(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "src")
    quantize(str(tmp_path / "src"), str(tmp_path / "q"), act_quant=True, calibration=IDS, progress=False)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    igs = {n: tensors[f"{n}.input_global_scale"] for n in LAYERS}
    assert torch.equal(igs["model.layers.0.self_attn.q_proj"], igs["model.layers.0.self_attn.v_proj"])  # one input
    eng = engine(tmp_path / "q")
    w4a16 = eng.score(IDS)
    assert set_act_quant(eng.runner.model, True) == 8
    ref = reference(src, default_precisions())
    for name in LAYERS:                                   # W4A4: fake-quantise each linear's input with its scale
        module = ref.get_submodule(name)
        module.forward = lambda x, m=module, s=igs[name]: F.linear(fake_quantise(x, s), m.weight)
    got = eng.score(IDS)
    # inputs a few fp32 ulps apart could round to different E2M1 codes; with these fixed inputs none do
    assert (got - logits(ref)).abs().max().item() < 1e-5
    assert (got - w4a16).abs().max().item() > 1e-3        # and activation quantisation does change the result
    flagged = LLMEngine(EngineConfig(model=str(tmp_path / "q"), progress=False, num_kv_blocks=64, device="cpu",
                                     nvfp4_act_quant=True))   # what `upesi target --nvfp4-act-quant` does
    assert torch.equal(flagged.score(IDS), got)
    with pytest.raises(ValueError, match="no NVFP4 layers"):
        LLMEngine(EngineConfig(model=str(tmp_path / "src"), progress=False, num_kv_blocks=64, nvfp4_act_quant=True))


@pytest.mark.parametrize("act_quant", [False, True])
def test_nvfp4_linear_segments_match_the_per_layer_reference(act_quant: bool) -> None:
    g = torch.Generator().manual_seed(3)
    weights = [quantise_weight(torch.randn(n, 48, generator=g) * s) for n, s in ((32, 1.0), (16, 0.01), (16, 50.0))]
    for i, w in enumerate(weights):
        w.input_global_scale = torch.tensor([100.0 + 50 * i])           # q/k/v calibrated apart
    layer = NVFP4Linear(48, [32, 16, 16], bias=True, act_quant=act_quant, input_scales=True)
    for i, w in enumerate(weights):
        layer.load_segment(i, w)
    layer.bias.data = torch.randn(64, generator=g)
    assert torch.equal(layer.dequantise(), torch.cat([w.dequantise() for w in weights]))
    x = torch.randn(5, 48, generator=g)
    expect = torch.cat([nvfp4_linear(x, w, act_quant, b) for w, b in zip(weights, layer.bias.split([32, 16, 16]))], -1)
    # W4A16 on CPU runs shared.ops.qgemm's kernel: the same products, summed in another order
    tol = 1e-6 if act_quant or layer.packed is None else 1e-5 * expect.abs().max().item()
    torch.testing.assert_close(layer(x), expect, rtol=1e-6 if tol == 1e-6 else 1e-5, atol=tol)
    layer.to(torch.bfloat16)                              # the packed format survives a dtype cast; the bias follows
    assert (layer.weight_packed.dtype, layer.weight_scale.dtype, layer.weight_global_scale.dtype) == \
        (torch.uint8, torch.float8_e4m3fn, torch.float32)
    assert layer.bias.dtype == torch.bfloat16 and layer(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(NVFP4ShapeError, match="segment"):
        layer.load_segment(1, weights[0])
    with pytest.raises(NVFP4ShapeError, match="input_global_scale is missing"):
        layer.load_segment(0, quantise_weight(torch.randn(32, 48)))


@pytest.fixture()
def interpreted_nvfp4():
    """The NVFP4 kernel module under TRITON_INTERPRET=1 for one test (shared.testing.triton_cpu)."""
    from shared.testing.triton_cpu import interpreted
    with interpreted("shared.quant.nvfp4_triton"):
        yield


def test_nvfp4_linear_triton_path_matches_torch_path(interpreted_nvfp4) -> None:
    """The CUDA branch (one Triton launch per segment, per-segment global scales) under TRITON_INTERPRET=1."""
    g = torch.Generator().manual_seed(4)
    layer = NVFP4Linear(64, [32, 16, 16], bias=True)
    for i, (n, s) in enumerate(((32, 1.0), (16, 0.01), (16, 50.0))):
        layer.load_segment(i, quantise_weight(torch.randn(n, 64, generator=g) * s))
    layer.bias.data = torch.randn(64, generator=g)
    x = torch.randn(3, 5, 64, generator=g)
    # the kernel divides the fp32 sum by the global scale at the end, torch scales each weight first: both are
    # within the fp32 dot-product error bound K * eps * sum |x| |w| of the exact result
    bound = 64 * 2.0 ** -23 * (x.abs() @ layer.dequantise().abs().T) + 1e-6
    assert ((layer.forward_triton(x) - layer(x)).abs() <= 2 * bound).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantized_model_on_cuda_matches_cpu(tmp_path: Path) -> None:
    save_tiny(tmp_path / "src")
    quantize(str(tmp_path / "src"), str(tmp_path / "q"), progress=False)
    cuda = LLMEngine(EngineConfig(model=str(tmp_path / "q"), progress=False, num_kv_blocks=64, device="cuda",
                                  dtype="float32"))
    assert isinstance(cuda.runner.model.layers[0].self_attn.qkv_proj, NVFP4Linear)
    torch.testing.assert_close(cuda.score(IDS).cpu(), engine(tmp_path / "q").score(IDS), rtol=1e-4, atol=1e-4)


def test_bad_checkpoints_and_policies_fail_with_a_message(tmp_path: Path) -> None:
    save_tiny(tmp_path / "src")
    quantize(str(tmp_path / "src"), str(tmp_path / "q"), progress=False)
    weights = load_file(str(tmp_path / "q" / "model.safetensors"))
    from safetensors.torch import save_file
    del weights["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(weights, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="model.layers.1.mlp.up_proj.weight_scale"):
        engine(tmp_path / "q")
    config_path = tmp_path / "q" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"].append("model.layers.0.self_attn.k_proj")   # k apart from q and v
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match="fused into layers.0.self_attn.qkv_proj"):
        engine(tmp_path / "q")
    with pytest.raises(PolicyError, match="already quantised"):
        quantize(str(tmp_path / "q"), str(tmp_path / "again"))
    (tmp_path / "bad.json").write_text('{"*": "int3"}')
    with pytest.raises(PolicyError, match="int3"):
        quantize(str(tmp_path / "src"), str(tmp_path / "x"), policy=str(tmp_path / "bad.json"))
    with pytest.raises(PolicyError, match="memory-budget"):
        quantize(str(tmp_path / "src"), str(tmp_path / "x"), policy="auto")
    assert parse_size("1.5MB") == 1_500_000 and parse_size("2GiB") == 2 * 2**30
    with pytest.raises(PolicyError):
        parse_size("lots")


def test_cli_quantize_then_serve(tmp_path: Path, capsys) -> None:
    from services.cli import main
    src = save_tiny(tmp_path / "src")
    (tmp_path / "p.json").write_text('{"*.down_proj": "bf16"}')
    main(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "q"), "--policy", str(tmp_path / "p.json"),
          "--no-progress"])
    out = capsys.readouterr().out
    assert "wrote" in out and "bits/param" in out and "layers.0.mlp.down_proj (bf16)" in out
    precisions = default_precisions(**{f"model.layers.{i}.mlp.down_proj": "bf16" for i in range(2)})
    assert (engine(tmp_path / "q").score(IDS) - logits(reference(src, precisions))).abs().max().item() < 1e-5


def to_modelopt(src: Path, dst: Path) -> None:
    """A compressed-tensors NVFP4 checkpoint rewritten in NVIDIA ModelOpt's layout: codes under `weight`, the
    reciprocal scales `weight_scale_2` and `input_scale`, hf_quant_config.json instead of quantization_config."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    ignore = config.pop("quantization_config")["ignore"]
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ignore, "kv_cache_quant_algo": None}}))
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            out[f"{prefix}.weight"] = t
        elif leaf == "weight_global_scale":
            out[f"{prefix}.weight_scale_2"] = (1 / t.float()).reshape(())
        elif leaf == "input_global_scale":
            out[f"{prefix}.input_scale"] = (1 / t.float()).reshape(())
        else:
            out[name] = t
    out["model.layers.0.self_attn.k_scale"] = torch.tensor(1.0)       # a KV-cache scale: read and dropped
    save_file(out, str(dst / "model.safetensors"))


@pytest.mark.parametrize("act_quant", [False, True])
def test_modelopt_checkpoints_are_served_as_they_are(tmp_path: Path, act_quant: bool) -> None:
    save_tiny(tmp_path / "src")
    quantize(str(tmp_path / "src"), str(tmp_path / "q"), act_quant=act_quant, calibration=IDS if act_quant else None,
             progress=False)
    to_modelopt(tmp_path / "q", tmp_path / "mo")
    ct, mo = engine(tmp_path / "q"), engine(tmp_path / "mo")
    assert sum(isinstance(m, NVFP4Linear) for m in mo.runner.model.modules()) == 8
    # the same codes; the global scales pass through a reciprocal and back, as ModelOpt's readers invert them
    got, want = mo.score(IDS), ct.score(IDS)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
