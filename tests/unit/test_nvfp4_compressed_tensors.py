"""Bit-exact agreement with compressed-tensors' own NVFP4 code (a test dependency, imported for real: a missing
package fails these tests rather than skipping them).

compressed-tensors computes scales in the dtype of the observations it is given; it is driven here with fp32
observations (w.float()), the arithmetic shared.quant.nvfp4 always uses.
"""
import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4, unpack_fp4_from_uint8
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam
from safetensors.torch import load_file, save_file

from shared.quant.checkpoint import (compressed_tensors_config, detect_layout, load_nvfp4_linear,
                                     to_compressed_tensors)
from shared.quant.nvfp4 import fake_quantise, global_scale_from_amax, quantise, quantise_weight, unpack

SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4)


def ct_qparams(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' global scale [1] and block scales [N, B] (fp8-rounded, held in fp32) for w [N, K]."""
    obs = w.float()
    gs = generate_gparam(obs.amin(), obs.amax())
    blocks = obs.unflatten(-1, (-1, 16))                                   # [N, B, 16]
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), SCHEME.weights, global_scale=gs)
    return gs, scale


def ct_compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    gs, scale = ct_qparams(w)
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, SCHEME)


def adversarial(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 128, generator=g)
    w[0] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2).repeat(8)  # E2M1 ties at step 1 (gs 448)
    w[0, 16:32] *= -1
    w[1] = w[0] / 2                                                        # ties at step 1/2
    w[2] = 0.0                                                             # zero blocks
    w[3, :16] = -0.0
    w[3, 16:32] = -1e-9                                                    # scale underflows -> 0.125 fallback
    w[4] *= 2.0 ** -12                                                     # subnormal fp8 scales
    w[5] = torch.linspace(-6, 6, 128)                                      # every bucket of the grid
    w[6, ::16] = 5.999                                                     # amax just under the top
    w[7] = torch.randint(-12, 13, (128,), generator=g) / 2                 # values on the grid and half-way
    return w


def random_tensor(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-20, 8, (48, 8, 1), generator=g).float())  # per-block magnitudes
    return (torch.randn(48, 8, 16, generator=g) * spread).reshape(48, 128).to(dtype)


CASES = [pytest.param(lambda: adversarial(0), id="adversarial"),
         pytest.param(lambda: adversarial(1).bfloat16(), id="adversarial-bf16"),
         pytest.param(lambda: torch.zeros(4, 32), id="all-zero")]
CASES += [pytest.param(lambda s=s, d=d: random_tensor(s, d), id=f"random-{s}-{str(d)[6:]}")
          for s in range(3) for d in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("make", CASES)
def test_same_bytes_and_scales_as_compressed_tensors(make) -> None:
    w = make()
    ct = ct_compress(w)
    ours = quantise_weight(w)
    assert torch.equal(ours.global_scale, ct["weight_global_scale"])
    assert torch.equal(ours.scale.view(torch.uint8), ct["weight_scale"].view(torch.uint8))
    assert torch.equal(ours.packed, ct["weight_packed"])
    # and compressed-tensors' dequantisation (bf16 out) of those bytes is ours rounded to bf16
    decompressed = NVFP4PackedCompressor.decompress(ct, SCHEME)["weight"]
    assert torch.equal(decompressed, ours.dequantise(torch.bfloat16))


def test_packing_primitive_matches_on_the_given_scales() -> None:
    x = adversarial(2)
    packed, scale, gs = quantise(x)
    assert torch.equal(quantize_and_pack_fp4(x, scale.float(), global_scale=gs), packed)
    values = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(unpack_fp4_from_uint8(packed, *x.shape, dtype=torch.float32), values[unpack(packed).long()])


def test_activation_fake_quant_matches_compressed_tensors() -> None:
    x = random_tensor(7, torch.float32)[:8] * 3
    igs = global_scale_from_amax(x.abs().amax() * 0.8)                     # a static scale that clips a little
    args = SCHEME.input_activations
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=None, global_scale=igs)
    ref = fake_quantize(x=x, scale=scale, zero_point=zp, args=args, global_scale=igs)
    assert torch.equal(fake_quantise(x, igs), ref)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 32, bias=False)
        self.down_proj = torch.nn.Linear(32, 48)
        self.lm_head = torch.nn.Linear(48, 16, bias=False)


def write_ct_checkpoint(path: Path) -> Tiny:
    """compressed-tensors' save path: apply the NVFP4 preset, calibrate with its helpers, compress, save."""
    torch.manual_seed(0)
    model = Tiny()
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **NVFP4)},
                                ignore=["lm_head"], quantization_status="calibration")
    apply_quantization_config(model, config)
    for lin in (model.q_proj, model.down_proj):
        gs, scale = ct_qparams(lin.weight.data)
        lin.weight_global_scale.data.copy_(gs)
        lin.weight_scale.data.copy_(scale)
        lin.input_global_scale.data.copy_(generate_gparam(torch.tensor(-3.0), torch.tensor(2.5)))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    compressor.update_config(str(path))
    return model


def test_compressed_tensors_checkpoint_loads_identically(tmp_path: Path) -> None:
    write_ct_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert detect_layout(config) == "compressed-tensors"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    reference = CompressedTensorsDequantizer(tmp_path, dtype=torch.bfloat16).process(dict(tensors))
    for prefix in ("q_proj", "down_proj"):
        w = load_nvfp4_linear(tensors, prefix, "compressed-tensors")
        assert torch.equal(w.dequantise(torch.bfloat16), reference[f"{prefix}.weight"])
        assert torch.equal(w.input_global_scale, generate_gparam(torch.tensor(-3.0), torch.tensor(2.5)))


@pytest.mark.parametrize("act_quant", [True, False])
def test_our_checkpoint_loads_into_compressed_tensors(tmp_path: Path, act_quant: bool) -> None:
    torch.manual_seed(1)
    weights = {"model.layers.0.mlp.up_proj": torch.randn(64, 96), "model.layers.0.self_attn.o_proj": adversarial(3)}
    igs = global_scale_from_amax(torch.tensor(5.0)) if act_quant else None
    tensors = {k: v for p, w in weights.items() for k, v in to_compressed_tensors(p, w, igs).items()}
    tensors["lm_head.weight"] = torch.randn(8, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["Tiny"], "quantization_config": compressed_tensors_config(act_quant=act_quant)}
    (tmp_path / "config.json").write_text(json.dumps(config))

    preset = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], format="nvfp4-pack-quantized", **(NVFP4 if act_quant else NVFP4A16))},
        ignore=["lm_head"], format="nvfp4-pack-quantized", quantization_status="compressed")
    assert QuantizationConfig.model_validate(config["quantization_config"]).model_dump() == preset.model_dump()
    dequantizer = CompressedTensorsDequantizer(tmp_path, dtype=torch.bfloat16)
    reference = dequantizer.process(load_file(str(tmp_path / "model.safetensors")))
    for prefix, w in weights.items():
        assert torch.equal(reference[f"{prefix}.weight"], quantise_weight(w).dequantise(torch.bfloat16))
        # W4A4: the dense export keeps the activation scale (its validate() would call it an orphan qparam)
        assert (f"{prefix}.input_global_scale" in reference) == act_quant
    if not act_quant:
        dequantizer.validate(load_file(str(tmp_path / "model.safetensors")))  # no leftover qparams
    assert torch.equal(reference["lm_head.weight"], tensors["lm_head.weight"])


def test_modelopt_layer_loads_like_compressed_tensors_converter() -> None:
    ours = quantise_weight(adversarial(4), input_global_scale=global_scale_from_amax(torch.tensor(7.0)))
    modelopt = {"layers.0.gate_proj.weight": ours.packed, "layers.0.gate_proj.weight_scale": ours.scale,
                "layers.0.gate_proj.weight_scale_2": (1 / ours.global_scale).reshape(()),
                "layers.0.gate_proj.input_scale": (1 / ours.input_global_scale).reshape(())}
    loaded = load_nvfp4_linear(modelopt, "layers.0.gate_proj", "modelopt")
    converted = ModelOptNvfp4Converter(targets=["Linear"]).process(dict(modelopt))
    # the converter keeps ModelOpt's 0-dim scalars; a compressed-tensors checkpoint holds [1] (and with a 0-dim
    # global scale, compressed-tensors' decompress would divide the scales in bf16 instead of fp32)
    state = {k.rpartition(".")[2]: v if v.ndim else v.reshape(1) for k, v in converted.items()}
    assert torch.equal(loaded.global_scale, state["weight_global_scale"])
    assert torch.equal(loaded.input_global_scale, state["input_global_scale"])
    reference = NVFP4PackedCompressor.decompress(state, SCHEME)["weight"]
    assert torch.equal(loaded.dequantise(torch.bfloat16), reference)
