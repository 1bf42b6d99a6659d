"""Prepacked bf16 linears (shared.ops.packed_linear) against their torch reference, F.linear: bit-identical on
oneDNN's packed path; the AVX512-BF16 rows kernel (shared.ops.rows_gemm_bf16, where it runs) within bf16
rounding of it, tested in tests/unit/test_rows_gemm_bf16.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.ops.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="no oneDNN prepacked bf16 linear (torch build or CPU)")


@pytest.fixture
def onednn(monkeypatch):
    """bf16 packing into oneDNN's layout even where the AVX512-BF16 rows kernel would take it."""
    from shared.ops import rows_gemm_bf16
    monkeypatch.setattr(rows_gemm_bf16, "packable", lambda w: False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (9, 576), (40, 576), (2, 5, 576)])
def test_packed_linear_equals_f_linear(shape, bias, onednn):
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    want = F.linear(x, lin.weight, lin.bias)
    got = PackedLinear(lin.weight, lin.bias)(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("bias", [False, True])
def test_default_bf16_packing_is_within_rounding_of_f_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, 9, 576, dtype=torch.bfloat16)
    got = PackedLinear(lin.weight, lin.bias)(x)
    assert got.shape == (2, 9, 960) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-2, atol=1e-2)


def test_pack_linears_replaces_bf16_cpu_linears_only(monkeypatch, onednn):
    from shared.ops import rows_gemm

    monkeypatch.setattr(rows_gemm, "available", lambda: False)         # fp32 packs only into the AVX2 rows kernel
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 4)))
    assert pack_linears(net) == 0                                        # fp32 without that kernel: untouched
    assert all(type(m) is not PackedLinear for m in net.modules())
    net = net.to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    want = net(x)
    assert pack_linears(net, keep_weight=("2.0",), skip=("2.1",)) == 2
    assert type(net[0]) is PackedLinear and not hasattr(net[0], "weight")
    assert type(net[2][0]) is PackedLinear and net[2][0].weight.shape == (4, 16)    # kept
    assert type(net[2][1]) is nn.Linear                                               # skipped
    assert torch.equal(net(x), want)


def test_a_bf16_model_packs_its_linears_and_keeps_its_logits(tmp_path, monkeypatch):
    """build_model packs a bf16 CPU Llama (the LM head keeps its tensor); the logits equal an unpacked build's."""
    from shared.model import registry
    from shared.testing.tiny_llama import save_tiny

    save_tiny(tmp_path, None, tie=False)
    packed, _ = registry.build_model(str(tmp_path), 64, torch.bfloat16, "cpu", progress=False)
    monkeypatch.setattr(registry, "pack_linears", lambda *a, **k: 0)
    plain, _ = registry.build_model(str(tmp_path), 64, torch.bfloat16, "cpu", progress=False)
    assert type(packed.layers[0].self_attn.qkv_proj) is PackedLinear
    assert type(packed.layers[0].mlp.down_proj) is PackedLinear
    assert type(packed.lm_head) is PackedLinear and packed.lm_head.weight.shape == (96, 64)
    assert type(plain.layers[0].self_attn.qkv_proj) is nn.Linear
    hidden = torch.randn(7, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed.compute_logits(hidden), plain.compute_logits(hidden))
        assert torch.equal(packed.layers[1].mlp(hidden), plain.layers[1].mlp(hidden))
