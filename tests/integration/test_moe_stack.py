"""The five MoE families with their FFNs on real `upesi experts` processes, 2 and 3 shards: greedy generation of 32
tokens equals transformers' `generate` on the same tiny checkpoint (shared/testing/moe_checkpoints.py); OLMoE also
through the whole running stack (`upesi serve` with its expert shards).

The target is the in-process engine (the same classes `upesi target` runs) with `attach_expert_shards`, so the local
FFN weights are freed and every routed expert (and every dense FFN, split by neurons) is computed by the shard
processes over gRPC; shared experts stay on the target. All shard processes of the module start at once and boot
while transformers computes the references.
"""
from __future__ import annotations

import subprocess

import pytest

from shared.testing.moe_checkpoints import FAMILIES, PROMPTS, hf_greedy, save_tiny, start_shard, stop_all
from tests.conftest import free_port

pytestmark = pytest.mark.slow
SHARDS = (2, 3)
TOKENS = 32


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (checkpoint folder, {shards: addresses}, transformers' greedy tokens of PROMPTS)."""
    root = tmp_path_factory.mktemp("moe_stack")
    procs: list[subprocess.Popen] = []
    with open(root / "shards.log", "w") as log:
        try:
            made = {}
            for family in FAMILIES:
                path = str(root / family)
                ref = save_tiny(path, family)
                addresses = {n: [f"127.0.0.1:{free_port()}" for _ in range(n)] for n in SHARDS}
                procs += [start_shard(path, i, n, a, log) for n in SHARDS for i, a in enumerate(addresses[n])]
                made[family] = (path, addresses, ref)
            yield {f: (path, addresses, hf_greedy(ref, PROMPTS, TOKENS)) for f, (path, addresses, ref) in made.items()}
        finally:
            stop_all(procs)


@pytest.mark.parametrize("n", SHARDS, ids=lambda n: f"{n}shards")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_through_expert_shards_equals_transformers(families, family, n):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.model.placement import Placement, num_routed_experts
    from shared.sampling_params import SamplingParams
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds

    path, addresses, expect = families[family]
    eng = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64))
    model = eng.runner.model
    client = ExpertsClient(addresses[n], Placement(n, num_routed_experts(eng.model_cfg)), ffn_kinds(model),
                           timeout_s=30)
    try:
        client.wait_ready(eng.model_cfg, timeout_s=180)
        assert attach_expert_shards(model, client) > 0                   # the local FFN weights are gone
        out = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
        assert [o[0] for o in out] == expect
        infos = client.shard_info()
        assert [i.shard_index for i in infos] == list(range(n)) and all(i.dispatches > 0 for i in infos)
        assert sum(i.dispatches for i in infos) == client.num_rpcs
    finally:
        client.close()


def test_olmoe_through_the_running_stack_with_expert_shards(tmp_path):
    """OLMoE (64 experts, top 8) served by `upesi serve` with 2 expert shards, through the router's gRPC API:
    greedy tokens equal transformers', plainly and with n-gram drafts verified by the target."""
    from shared.testing.moe_checkpoints import save_tokenizer, stack_greedy
    from tests.conftest import Stack

    model = tmp_path / "olmoe"
    ref = save_tiny(model, "olmoe")
    save_tokenizer(model)                                # "t5 t17" is the prompt [5, 17]
    want = hf_greedy(ref, PROMPTS, 24)
    stack = Stack(tmp_path, ["--model", str(model), "--speculative", "ngram", "--num-threads", "1",
                             "--expert-shards", "2", "--expert-metrics-port", "0"])
    try:
        stack.wait_ready()
        for k in (0, 3):                                 # plain, then n-gram drafts verified by the target
            assert stack_greedy(stack.address, PROMPTS, 24, k) == want, f"num_speculative_tokens={k}"
    finally:
        assert stack.stop() == 0, stack.log.read_text()[-3000:]
