"""NVFP4 format: E2M1 rounding, packing, block / global scales, error bound, errors, and the torch linear paths."""
import pytest
import torch

from shared.quant.checkpoint import (CheckpointFormatError, compressed_tensors_config, detect_layout,
                                     load_nvfp4_linear, to_compressed_tensors)
from shared.quant.nvfp4 import (FP8_ZERO_SCALE, NonFiniteInputError, NVFP4Error, NVFP4ShapeError, NVFP4Weight,
                                dequantise, e2m1_decode, e2m1_encode, fake_quantise, global_scale_from_amax, pack,
                                quantise, quantise_weight, unpack)
from shared.quant.nvfp4_linear import nvfp4_linear

# value -> expected code magnitude index (0..7 for 0, .5, 1, 1.5, 2, 3, 4, 6)
TIES = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
GRID = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
SATURATION = {4.999: 6, 5.001: 7, 6.0: 7, 6.5: 7, 7.0: 7, 1e30: 7}
NEAR = {0.2499: 0, 0.2501: 1, 0.7499: 1, 1.2501: 3, 1.7499: 3, 2.5001: 5, 3.4999: 5}


@pytest.mark.parametrize("table", [TIES, GRID, SATURATION, NEAR], ids=["ties", "grid", "saturation", "near"])
def test_e2m1_encode_rounds_to_nearest_even_and_saturates(table: dict[float, int]) -> None:
    values = torch.tensor(list(table), dtype=torch.float32)
    expected = torch.tensor(list(table.values()), dtype=torch.uint8)
    assert e2m1_encode(values).tolist() == expected.tolist()
    # negatives: same magnitude, sign bit set; a negative value rounding to zero keeps its sign (code 8)
    assert e2m1_encode(-values[values > 0]).tolist() == (expected[values > 0] | 8).tolist()


def test_negative_zero_input_and_decode_table() -> None:
    assert e2m1_encode(torch.tensor([-0.0, 0.0, -0.1])).tolist() == [0, 0, 8]
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    expected = codes.clone()
    expected[8] = 0                                                        # -0.0 re-encodes as +0 (code 0)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), expected)


def test_pack_puts_even_element_in_low_nibble() -> None:
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    assert pack(codes).tolist() == [[0x21, 0x8F]]
    rnd = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    assert torch.equal(unpack(pack(rnd)), rnd)


def test_quantise_with_unit_step_encodes_ties_exactly() -> None:
    # global scale 448 with a block amax of 6 gives block scale 448 -> step 448/448 = 1: codes are e2m1(x) itself
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    packed, scale, gs = quantise(torch.tensor([row]), global_scale=torch.tensor([448.0]))
    assert scale.float().tolist() == [[448.0]] and gs.tolist() == [448.0]
    assert unpack(packed)[0].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 15]
    assert dequantise(packed, scale, gs)[0].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, -6]


def _error_bound(x: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Per-element bound [..., K]: one step d = scale / gs (half the widest E2M1 gap, 4 -> 6, is one step),
    or, where fp8 rounded a subnormal scale down, the saturation loss amax - 6 d <= 6 * 2^-10 / gs."""
    d = scale.float() / gs                                                 # [..., B]
    bound = torch.maximum(d, torch.full_like(d, 6 * 2.0 ** -10) / gs)
    return bound.repeat_interleave(16, dim=-1) * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_stays_within_block_error_bound(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # blocks spanning ~40 binades so some scales are subnormal fp8 and some tiny blocks hit the 0.125 fallback
    x = torch.randn(32, 256, generator=g) * torch.exp2(torch.randint(-30, 10, (32, 16, 1), generator=g)
                                                         ).repeat_interleave(16, -1).reshape(32, 256)
    packed, scale, gs = quantise(x)
    err = (dequantise(packed, scale, gs) - x).abs()
    assert (err <= _error_bound(x, scale, gs)).all()
    s = scale.float()
    assert ((s > 0) & (s < 2.0 ** -6)).any(), "test should cover subnormal fp8 scales"
    normal = (s >= 2.0 ** -6).repeat_interleave(16, dim=-1)
    assert (err[normal] <= (s / gs).repeat_interleave(16, dim=-1)[normal] * (1 + 1e-6)).all()


def test_zero_blocks_and_all_zero_tensor() -> None:
    x = torch.randn(4, 64)
    x[1, 16:32] = 0.0
    packed, scale, gs = quantise(x)
    assert scale[1, 1].float().item() == FP8_ZERO_SCALE
    assert unpack(packed)[1, 16:32].eq(0).all() and dequantise(packed, scale, gs)[1, 16:32].eq(0).all()
    packed, scale, gs = quantise(torch.zeros(2, 32))
    assert gs.tolist() == [1.0] and scale.float().eq(FP8_ZERO_SCALE).all() and packed.eq(0).all()
    assert global_scale_from_amax(0.0).tolist() == [1.0] and global_scale_from_amax(6.0).tolist() == [448.0]


def test_subnormal_block_scale_is_kept() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1.0, 3e-5            # second block scale = 3e-5 / 6 * 2688 ~ 0.0134: fp8 subnormal
    packed, scale, gs = quantise(x)
    bits = scale.view(torch.uint8)[0, 1].item()
    assert bits >> 3 == 0 and bits & 7 != 0  # exponent field 0, non-zero mantissa
    assert abs(dequantise(packed, scale, gs)[0, 16].item() - 3e-5) <= 6 * 2.0 ** -10 / gs.item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_value_error(bad: float) -> None:
    x = torch.randn(2, 32)
    x[1, 3] = bad
    with pytest.raises(NonFiniteInputError) as info:
        quantise(x)
    assert isinstance(info.value, ValueError) and "NaN" in str(info.value)


def test_shape_and_dtype_errors() -> None:
    with pytest.raises(NVFP4ShapeError):
        quantise(torch.randn(3, 20))
    with pytest.raises(NVFP4ShapeError):
        quantise_weight(torch.randn(32))
    w = quantise_weight(torch.randn(8, 32))
    with pytest.raises(NVFP4ShapeError):
        NVFP4Weight(w.packed, w.scale[:, :1], w.global_scale)
    with pytest.raises(NVFP4ShapeError):
        NVFP4Weight(w.packed.to(torch.int16), w.scale, w.global_scale)
    with pytest.raises(NVFP4Error):
        NVFP4Weight(w.packed, w.scale, torch.tensor([float("inf")]))
    with pytest.raises(NVFP4ShapeError):
        nvfp4_linear(torch.randn(2, 48), w)


def test_w4a16_is_dequantised_matmul() -> None:
    w = quantise_weight(torch.randn(24, 64))
    x, bias = torch.randn(3, 5, 64), torch.randn(24)
    ref = x @ w.dequantise().T + bias
    torch.testing.assert_close(nvfp4_linear(x, w, bias=bias), ref, rtol=1e-6, atol=1e-5)
    y16 = nvfp4_linear(x.bfloat16(), w)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), x.bfloat16().float() @ w.dequantise().T, rtol=2 ** -8, atol=1e-3)


def test_w4a4_quantises_activations_per_block() -> None:
    x = torch.randn(6, 64) * 3
    static = global_scale_from_amax(torch.tensor(10.0))
    w = quantise_weight(torch.randn(16, 64), input_global_scale=static)
    xq = fake_quantise(x, static)
    torch.testing.assert_close(nvfp4_linear(x, w, act_quant=True), xq @ w.dequantise().T, rtol=1e-6, atol=1e-5)
    packed, scale, gs = quantise(x, static)                                # the activations sit on the NVFP4 grid
    assert torch.equal(xq, dequantise(packed, scale, gs)) and (xq - x).abs().max() <= 1.0 * scale.float().max() / gs
    dynamic = quantise_weight(torch.randn(16, 64))                         # no input_global_scale: amax on the fly
    torch.testing.assert_close(nvfp4_linear(x, dynamic, act_quant=True),
                               fake_quantise(x) @ dynamic.dequantise().T, rtol=1e-6, atol=1e-5)
    with pytest.raises(NonFiniteInputError):
        nvfp4_linear(torch.full((1, 64), float("nan")), w, act_quant=True)


def test_checkpoint_round_trip_both_layouts() -> None:
    weight = torch.randn(32, 64)
    igs = global_scale_from_amax(torch.tensor(4.0))
    ct = to_compressed_tensors("model.layers.0.q_proj", weight, igs)
    assert detect_layout({"quantization_config": compressed_tensors_config()}) == "compressed-tensors"
    loaded = load_nvfp4_linear(ct, "model.layers.0.q_proj", "compressed-tensors")
    ref = quantise_weight(weight)
    assert torch.equal(loaded.packed, ref.packed) and torch.equal(loaded.input_global_scale, igs)
    modelopt = {"l.weight": ref.packed, "l.weight_scale": ref.scale, "l.weight_scale_2": (1 / ref.global_scale)[0],
                "l.input_scale": (1 / igs)[0]}
    assert detect_layout({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}) == "modelopt"
    assert detect_layout({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}) == "modelopt"
    mo = load_nvfp4_linear(modelopt, "l", "modelopt")
    torch.testing.assert_close(mo.dequantise(), ref.dequantise(), rtol=2 ** -22, atol=0)
    assert detect_layout({"quantization_config": {"quant_method": "fp8"}}) is None
    with pytest.raises(CheckpointFormatError, match="l.weight_scale_2"):
        load_nvfp4_linear({"l.weight": ref.packed, "l.weight_scale": ref.scale}, "l", "modelopt")
    with pytest.raises(CheckpointFormatError):
        load_nvfp4_linear(ct, "model.layers.0.q_proj", "gguf")  # type: ignore[arg-type]
