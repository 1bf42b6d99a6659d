"""Automatic rebalancing on a running stack: `upesi target --rebalance-interval-s` with two `upesi experts` shards,
on a tiny DeepSeek-V3 whose correction bias sends every token to experts 0 and 1, both on shard 0 (a skewed workload).

Shows: the rebalancer fires by itself once it has measured enough load, it replicates the hot experts onto shard 1
(LoadExperts) and switches the placement; the shards' measured load (slots each shard computed, from their Info)
goes from max/mean 5/3 (dense layer 0 split evenly, both MoE layers on shard 0) to about 1.0; greedy tokens are the
same before, during and after, and equal the in-process engine's.
"""
from __future__ import annotations

import concurrent.futures as cf
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from shared.testing.moe_checkpoints import PROMPTS, save_tiny, start_shard, stop_all
from tests.conftest import ROOT, free_port
from upesi.v1 import experts_pb2, experts_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow
TOKENS = 32
SKEWED = [[(7 * i + 3 * j) % 100 + 1 for j in range(24)] for i in range(6)]      # more load, same routing


def _metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("upesi_expert_rebalances") or s.name == "upesi_expert_imbalance"}


def _generate(stub, prompt: list[int], rid: str) -> list[int]:
    req = target_pb2.TargetGenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=target_pb2.SamplingParams(
        temperature=0, top_p=1, max_tokens=TOKENS, ignore_eos=True))
    return [t for r in stub.Generate(req, timeout=120) for d in r.deltas for t in d.token_ids]


def _slots(shards) -> list[int]:
    return [s.Info(experts_pb2.ShardInfoRequest(), timeout=10).slots for s in shards]


def test_rebalancer_replicates_hot_experts_and_evens_the_shards_load(tmp_path):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.sampling_params import SamplingParams

    path = str(tmp_path / "ds")
    save_tiny(path, "deepseek_v3_skewed")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    target, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    log = open(tmp_path / "stack.log", "w")
    procs = [start_shard(path, i, 2, a, log) for i, a in enumerate(addresses)]
    procs.append(subprocess.Popen([
        sys.executable, "-m", "services.cli", "target", "--model", path, "--address", target, "--metrics-port",
        str(metrics_port), "--num-kv-blocks", "128", "--progress", "false", "--num-threads", "1",
        "--expert-shards", ",".join(addresses), "--rebalance-interval-s", "0.5"], cwd=ROOT, stdout=log,
        stderr=subprocess.STDOUT))
    try:
        local = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=64))
        want = [o[0] for o in local.generate(PROMPTS[:1] + SKEWED, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                                  ignore_eos=True))]
        with grpc.insecure_channel(target) as tc, grpc.insecure_channel(addresses[0]) as c0, \
                grpc.insecure_channel(addresses[1]) as c1:
            stub = target_pb2_grpc.TargetStub(tc)
            stub.Info(target_pb2.InfoRequest(), wait_for_ready=True, timeout=180)
            shards = [experts_pb2_grpc.ExpertsStub(c) for c in (c0, c1)]

            # one short request (fewer slots than the rebalancer waits for): the load before
            s0 = _slots(shards)
            assert _generate(stub, PROMPTS[0], "before") == want[0]
            before = [b - a for a, b in zip(s0, _slots(shards))]
            assert _metrics(metrics_port).get("upesi_expert_rebalances_total", 0) == 0

            # the skewed workload, concurrent; the rebalancer fires on its own
            with cf.ThreadPoolExecutor(len(SKEWED)) as ex:
                got = list(ex.map(lambda i: _generate(stub, SKEWED[i], f"skewed-{i}"), range(len(SKEWED))))
            assert got == want[1:]
            deadline = time.monotonic() + 60
            while (m := _metrics(metrics_port)).get("upesi_expert_rebalances_total", 0) < 1:
                assert time.monotonic() < deadline, log.name
                time.sleep(0.25)

            # the same short request again: same tokens, load now spread over both shards
            s1 = _slots(shards)
            assert _generate(stub, PROMPTS[0], "after") == want[0]
            after = [b - a for a, b in zip(s1, _slots(shards))]
            held = [s.Info(experts_pb2.ShardInfoRequest(), timeout=10).held for s in shards]
    finally:
        stop_all(procs[::-1])
        log.close()
    imb_before, imb_after = max(before) / (sum(before) / 2), max(after) / (sum(after) / 2)
    print(f"\nshard slots of one request: before {before} (max/mean {imb_before:.2f}), after {after} "
          f"(max/mean {imb_after:.2f}); rebalancer gauge (latest window) "
          f"{m['upesi_expert_imbalance']:.2f}, units held {held}")
    assert imb_before == pytest.approx(5 / 3, abs=0.01)      # per token: shard 0 = 1 slice + 2 x 2 experts, shard 1 = 1
    assert imb_after < 1.1
    assert held == [1 + 2 * 4, 1 + 2 * 4 + 4]                 # shard 1 loaded experts 0 and 1 of both MoE layers
    # the rebalancer's own figures (expected shard load from the measured per-expert load): 2.0 (every routed slot
    # on shard 0) -> 1.0; its gauge shows the latest window, balanced once the replicas took traffic
    fired = re.search(r"rebalanced 2 layers: worst imbalance ([\d.]+) -> ([\d.]+)",
                      (tmp_path / "stack.log").read_text())
    assert fired and (float(fired[1]), float(fired[2])) == (2.0, 1.0)
    assert 1.0 <= m["upesi_expert_imbalance"] <= 2.0
