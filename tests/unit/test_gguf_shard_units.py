"""An expert shard's units read from a GGUF file with quantised layers (services.experts.shard, no gRPC): the
default model's Q4_1 FFNs sliced across two shards stay packed (shared.ops.qgemm), and the slices' sum equals the
in-process layer's FFN; an OLMoE file's Q4_0 expert stacks likewise, expert by expert."""
from __future__ import annotations

import pytest
import torch

from services.experts.shard import ExpertShard
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.placement import Placement
from shared.ops import qgemm, qgemm_i8
from shared.quant.quant_linear import QuantLinear
from shared.testing.gguf_files import write_gguf
from shared.testing.moe_checkpoints import save_tiny

pytestmark = pytest.mark.skipif(not qgemm.available(), reason="needs the quantised kernel (AVX512-BF16)")


def test_default_model_ffn_slices_stay_packed_and_sum_to_the_layer(engine, model_path):
    shards = [ExpertShard(model_path, Placement(2), i, torch.float32, torch.device("cpu")) for i in range(2)]
    unit = shards[0].layers[0][0]
    assert isinstance(unit.gate_up, QuantLinear) and isinstance(unit.down, QuantLinear)
    i = engine.model_cfg.intermediate_size // 2                       # 768 of 1,536 neurons a shard
    d = engine.model_cfg.hidden_size
    assert unit.gate_up.packed_nbytes == int(2 * i * d * 0.625) and unit.down.packed_nbytes == int(d * i * 0.625)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(3, dtype=torch.int32)
    with torch.inference_mode():
        for layer in (0, 17):
            want = engine.runner.model.layers[layer].mlp(x)
            got = sum(sh.forward(layer, x, ids + i) for i, sh in enumerate(shards))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_olmoe_q4_experts_on_two_shards_equal_the_packed_model(tmp_path):
    from gguf.constants import GGMLQuantizationType as T
    ref = save_tiny(tmp_path / "hf", "olmoe")
    path = str(tmp_path / "olmoe-q.gguf")
    write_gguf(ref, "olmoe", path, quant=lambda n: T.Q4_0 if n.endswith(("experts.gate_proj", "experts.up_proj"))
               else None)
    model = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=16)).runner.model
    assert isinstance(model.layers[0].mlp.experts[5].gate_up_proj, QuantLinear)
    shards = [ExpertShard(path, Placement(2, 64), i, torch.float32, torch.device("cpu")) for i in range(2)]
    assert isinstance(shards[1].layers[0][40].gate_up, QuantLinear)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))                  # [T, D]
    ids = torch.tensor([[0, 33], [5, 60], [40, 1], [2, 31]])                             # [T, k]
    w = torch.rand(4, 2, generator=torch.Generator().manual_seed(1))                     # [T, k]
    flat, rows = ids.reshape(-1), torch.arange(4).repeat_interleave(2)
    with torch.inference_mode():
        want = model.layers[0].mlp.experts.moe(0, x, ids, w)
        got = sum(sh.forward(0, x, flat[flat // 32 == i].int(), w.reshape(-1)[flat // 32 == i],
                             rows[flat // 32 == i]) for i, sh in enumerate(shards))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not qgemm_i8.available(), reason="needs AVX512-VNNI")
def test_int8_activation_slices_sum_to_the_layer_on_int8_activations(model_path):
    """Slices cut on blocks quantise each block of x as the whole layer does, so they sum to its W4A8 result."""
    eng = LLMEngine(EngineConfig(model=model_path, progress=False, num_kv_blocks=16, int8_activations=True))
    shards = [ExpertShard(model_path, Placement(2), i, torch.float32, torch.device("cpu"), int8_activations=True)
              for i in range(2)]
    assert isinstance(shards[1].layers[3][1].down.packed, qgemm_i8.QWeightI8)
    x = torch.randn(3, eng.model_cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(3, dtype=torch.int32)
    with torch.inference_mode():
        want = eng.runner.model.layers[3].mlp(x)
        got = sum(sh.forward(3, x, ids + i) for i, sh in enumerate(shards))
        exact = shards[0].__class__(model_path, Placement(1), 0, torch.float32, torch.device("cpu")).forward(3, x, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (exact - want).abs().max() > 1e-3 * want.abs().max()                     # int8 activations in effect
