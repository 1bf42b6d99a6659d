"""Expert shards serving a quantised MoE checkpoint: a tiny Qwen2-MoE (routed experts, a dense layer split across
the shards, shared experts on the target) through `quantize` (the code of `upesi quantize`) with a policy that
mixes precisions: NVFP4 for most layers, FP8 for one expert and the dense layer's gate/up, bf16 for one expert's
down_proj (and the shared experts' down_proj, whose 40 inputs are no multiple of 16).

Shows, for W4A16 and for W4A4 (`--nvfp4-act-quant` on shards and target, calibrated input scales): greedy tokens
through 2 shard processes equal the in-process quantised engine's (same numerics: the shards run the target's own
NVFP4Linear / FP8Linear), and each shard holds the packed bytes of its units, not dense copies. And `upesi serve
--expert-shards 2 --nvfp4-act-quant` (router, target, shards) answers with the in-process W4A4 engine's tokens.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from shared.testing.moe_checkpoints import PROMPTS, save_tiny, save_tokenizer, start_shard, stop_all
from shared.testing.stack import free_port_run
from tests.conftest import free_port

pytestmark = pytest.mark.slow
TOKENS = 32
POLICY = {"model.layers.2.mlp.experts.1.*": "fp8", "model.layers.0.mlp.experts.3.down_proj": "bf16",
          "model.layers.1.mlp.up_proj": "fp8"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4_shards")
    save_tiny(root / "src", "qwen2_moe")
    save_tokenizer(root / "src")                             # quantize copies it: the router can serve the folder
    (root / "policy.json").write_text(json.dumps(POLICY))
    return root


def expected_shard_bytes(path: str, shard: int) -> tuple[int, int]:
    """(bytes the shard should hold: its units' checkpoint tensors as stored, float layers at 4 bytes a value;
    bytes of the same units in fp32) for 2 contiguous shards: experts 0, 1 / 2, 3 of MoE layers 0 and 2, and half of
    dense layer 1's neurons (every per-row tensor halves; per-tensor scales are held whole by both)."""
    held = packed = 0.0
    dense = 0
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            is_float = t.dtype.is_floating_point and t.element_size() >= 2 and not name.endswith("_scale")
            size = t.numel() * (4 if is_float else t.element_size())
            if ".mlp.experts." in name and int(name.split(".experts.")[1].split(".")[0]) // 2 == shard:
                held += size
            elif name.startswith("model.layers.1.mlp."):
                held += size if t.numel() == 1 else size / 2
            else:
                continue
            if name.endswith("weight_packed"):
                dense += 2 * t.numel() * 4 * (1 if ".experts." in name else 0.5)
            elif name.endswith(".weight"):
                dense += t.numel() * 4 * (1 if ".experts." in name else 0.5)
    return int(held), int(dense)


@pytest.mark.parametrize("act_quant", [False, True], ids=["W4A16", "W4A4"])
def test_quantised_moe_through_two_shards_equals_in_process(source, tmp_path, act_quant):
    from shared.convert.quantize import quantize
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.model.placement import Placement
    from shared.quant.nvfp4_module import FP8Linear, NVFP4Linear
    from shared.sampling_params import SamplingParams
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds

    out = str(tmp_path / "quantised")
    result = quantize(str(source / "src"), out, policy=str(source / "policy.json"), act_quant=act_quant,
                      calibration=list(range(1, 100)), progress=False)
    assert {"nvfp4", "fp8", "bf16"} <= set(result.unit_precisions.values())
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with open(tmp_path / "shards.log", "w") as log:
        flag = ("--nvfp4-act-quant",) if act_quant else ()
        procs = [start_shard(out, i, 2, a, log, extra=flag) for i, a in enumerate(addresses)]
        try:
            def engine():
                return LLMEngine(EngineConfig(model=out, progress=False, num_kv_blocks=64, nvfp4_act_quant=act_quant))
            local, remote = engine(), engine()
            expert = local.runner.model.layers[0].mlp.experts[0]
            assert isinstance(expert.gate_up_proj, NVFP4Linear) and expert.gate_up_proj.act_quant == act_quant
            assert isinstance(local.runner.model.layers[2].mlp.experts[1].down_proj, FP8Linear)
            params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
            want = [o[0] for o in local.generate(PROMPTS, params)]
            scored = list(range(1, 60))
            want_logits = local.score(scored)

            model = remote.runner.model
            client = ExpertsClient(addresses, Placement(2, 4), ffn_kinds(model), timeout_s=30)
            client.wait_ready(remote.model_cfg, timeout_s=180)
            attach_expert_shards(model, client)
            assert [o[0] for o in remote.generate(PROMPTS, params)] == want
            # teacher-forced logits too: a shard on the other side of --nvfp4-act-quant would be off by ~1e-1
            torch.testing.assert_close(remote.score(scored), want_logits, rtol=1e-5, atol=1e-5)
            infos = client.shard_info()
            client.close()
        finally:
            stop_all(procs)
    for i, info in enumerate(infos):
        held, dense = expected_shard_bytes(out, i)
        print(f"\nshard {i} ({'W4A4' if act_quant else 'W4A16'}): {info.weight_bytes} bytes held, {held} expected "
              f"packed, {dense} as fp32")
        assert info.dispatches > 0 and info.weight_bytes == held and held < 0.4 * dense


def test_upesi_serve_passes_act_quant_to_target_and_shards(source, tmp_path):
    import grpc

    from shared.convert.quantize import quantize
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from tests.conftest import Stack
    from upesi.v1 import generation_pb2 as pb
    from upesi.v1 import generation_pb2_grpc

    out = str(tmp_path / "quantised")
    quantize(str(source / "src"), out, policy=str(source / "policy.json"), act_quant=True,
             calibration=list(range(1, 100)), progress=False)
    base = free_port_run(3)
    stack = Stack(tmp_path, ["--model", out, "--expert-shards", "2", "--nvfp4-act-quant", "--target-address",
                             f"127.0.0.1:{base}", "--expert-metrics-port", "0"])
    try:
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        want = {}
        for act_quant in (True, False):
            eng = LLMEngine(EngineConfig(model=out, progress=False, num_kv_blocks=64, nvfp4_act_quant=act_quant))
            want[act_quant] = [o[0] for o in eng.generate(PROMPTS, params)]
        assert want[True] != want[False]                     # the flag shows in the tokens, so this can fail
        stack.wait_ready()
        with grpc.insecure_channel(stack.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            got = [list(stub.Generate(pb.GenerateRequest(prompt=" ".join(f"t{i}" for i in p), max_tokens=TOKENS,
                                                          temperature=0, ignore_eos=True), timeout=120)
                        .choices[0].token_ids) for p in PROMPTS]
        assert got == want[True]
    finally:
        assert stack.stop() == 0, stack.log.read_text()[-3000:]
