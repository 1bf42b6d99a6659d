"""A frozen expert shard (SIGSTOP) under an in-process engine with two real `upesi experts` processes on a tiny
DeepSeek-V3: calls whose units have replicas fail over as soon as the shard is far past its measured time, calls
whose units do not fail fast (its health check goes unanswered) instead of waiting for the call's deadline, and the
shard serves again once thawed. Neither kind reaches DEADLINE_EXCEEDED: the client's deadline here is 60 s."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from shared.testing.moe_checkpoints import save_tiny
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.slow


def _value(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


def test_a_frozen_shard_fails_over_or_fails_fast_and_serves_again_when_thawed(tmp_path):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.errors import PeerUnavailable
    from shared.model.placement import Placement
    from shared.sampling_params import SamplingParams
    from shared.shards.client import RPCS, STALLS, ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds

    save_tiny(tmp_path, "deepseek_v3")                   # layer 0 dense; layers 1, 2: 8 routed + 1 shared expert
    placement = Placement(2, 8, {1: tuple((0, 1) for _ in range(8))})     # layer 1 on both shards, 2 contiguous
    placement.save(str(tmp_path / "placement.json"))
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    log = open(tmp_path / "shards.log", "w")
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", "experts", "--model", str(tmp_path), "--address",
                               a, "--shard-index", str(i), "--num-shards", "2", "--expert-placement",
                               str(tmp_path / "placement.json"), "--num-threads", "1"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) for i, a in enumerate(addresses)]
    frozen = False
    try:
        local = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64))
        remote = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64))
        model = remote.runner.model
        client = ExpertsClient(addresses, placement, ffn_kinds(model), timeout_s=60.0, retry_after_s=1.0)
        client.wait_ready(remote.model_cfg, timeout_s=120)
        attach_expert_shards(model, client)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = [[5, 17, 29, 3, 77, 41, 8]]
        assert remote.generate(prompts, params) == local.generate(prompts, params)      # the shards' times measured
        assert all(t is not None for t in client._per_row)

        procs[1].send_signal(signal.SIGSTOP)
        frozen = True
        x, w = torch.randn(3, 64), torch.rand(3, 2)
        ids = torch.tensor([[0, 7], [3, 4], [6, 1]])
        stalls, deadlines = _value(STALLS, "1"), _value(RPCS, "1", "DEADLINE_EXCEEDED")
        stalled = _value(RPCS, "1", "STALLED")
        t0 = time.perf_counter()
        with torch.inference_mode():
            got = client.run(1, x, ids, w)                  # experts 4..7 (shard 1) fail over to their replicas
            want = local.runner.model.layers[1].mlp.backend.moe(1, x, ids, w)
        failover_s = time.perf_counter() - t0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert _value(STALLS, "1") == stalls + 1 and client._avoid() == {1}

        client._down_until[1] = 0.0                         # as if its avoidance ran out while it is still frozen
        t0 = time.perf_counter()
        with pytest.raises(PeerUnavailable, match="no replica"):
            with torch.inference_mode():
                client.run(2, x, torch.tensor([[6, 7]] * 3), w)     # experts on shard 1 only
        fail_fast_s = time.perf_counter() - t0
        assert _value(STALLS, "1") == stalls + 2
        assert _value(RPCS, "1", "STALLED") == stalled + 2
        assert _value(RPCS, "1", "DEADLINE_EXCEEDED") == deadlines        # given up on, never waited out
        print(f"fail-over {failover_s:.3f} s, fail-fast {fail_fast_s:.3f} s")

        procs[1].send_signal(signal.SIGCONT)
        frozen = False
        time.sleep(client.retry_after_s)
        assert remote.generate(prompts, params) == local.generate(prompts, params)
        client.close()
    finally:
        for p in procs:
            if frozen and p is procs[1]:
                p.send_signal(signal.SIGCONT)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        log.close()
