"""An expert shard's units read from a quantised checkpoint (services.experts.shard, no gRPC): a tiny Mixtral, whose
checkpoint names experts block_sparse_moe.experts.E.w1/w2/w3, through `quantize` (NVFP4, written under our names):
both shards together compute exactly what the in-process quantised model's experts compute, holding packed bytes."""
from __future__ import annotations

import torch

from services.experts.shard import ExpertShard
from shared.convert.quantize import quantize
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.placement import Placement
from shared.quant.nvfp4_module import NVFP4Linear
from shared.testing.moe_checkpoints import save_tiny


def test_mixtral_nvfp4_experts_on_two_shards_equal_the_quantised_model(tmp_path):
    save_tiny(tmp_path / "src", "mixtral")
    out = str(tmp_path / "nvfp4")
    quantize(str(tmp_path / "src"), out, progress=False)
    model = LLMEngine(EngineConfig(model=out, progress=False, num_kv_blocks=16)).runner.model
    assert isinstance(model.layers[0].mlp.experts[0].gate_up_proj, NVFP4Linear)
    shards = [ExpertShard(out, Placement(2, 4), i, torch.float32, torch.device("cpu")) for i in range(2)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))                  # [T, D]
    ids = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0], [1, 3]])                         # [T, k]
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))                     # [T, k]
    flat, rows = ids.reshape(-1), torch.arange(5).repeat_interleave(2)                   # [T k]
    with torch.inference_mode():
        for layer in range(3):
            want = model.layers[layer].mlp.experts.moe(layer, x, ids, w)
            got = sum(sh.forward(layer, x, flat[flat // 2 == i].int(), w.reshape(-1)[flat // 2 == i],
                                 rows[flat // 2 == i]) for i, sh in enumerate(shards))
            assert torch.equal(got, want)
    # per shard: 3 layers x 2 experts x (gate, up [48, 64] + down [64, 48]): 4.5 bits a weight + 4 B global scales
    weights = 3 * 2 * 3 * 48 * 64
    assert [sh.weight_bytes for sh in shards] == [weights // 2 + weights // 16 + 3 * 2 * 3 * 4] * 2
