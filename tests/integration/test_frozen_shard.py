"""A frozen expert shard (SIGSTOP) under an in-process engine with two real `upesi experts` processes on a tiny
DeepSeek-V3: calls whose units have replicas fail over as soon as the shard is far past its measured time, calls
whose units do not fail fast (its health check goes unanswered) instead of waiting for the call's deadline, and the
shard serves again once thawed. Neither kind reaches DEADLINE_EXCEEDED: the client's deadline here is 60 s."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from shared.testing.moe_checkpoints import save_tiny
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.slow


def _value(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


def _start(tmp_path, placement):
    """Two `upesi experts` processes on a tiny DeepSeek-V3 -> (procs, log file, addresses)."""
    placement.save(str(tmp_path / "placement.json"))
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    log = open(tmp_path / "shards.log", "w")
    procs = [subprocess.Popen([sys.executable, "-m", "services.cli", "experts", "--model", str(tmp_path), "--address",
                               a, "--shard-index", str(i), "--num-shards", "2", "--expert-placement",
                               str(tmp_path / "placement.json"), "--num-threads", "1"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) for i, a in enumerate(addresses)]
    return procs, log, addresses


def _stop(procs, log) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    log.close()


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
    procs, log, addresses = _start(tmp_path, placement)
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
        time.sleep(client.retry_after_s)
        assert remote.generate(prompts, params) == local.generate(prompts, params)
        client.close()
    finally:
        _stop(procs, log)


def test_a_slow_call_is_awaited_rather_than_failed_over_to_a_replica_that_has_not_served_since_it_failed(
        tmp_path, monkeypatch):
    """Shard 0 dies; once its avoidance runs out, a call to shard 1 that is slow (frozen for a while, then thawed) is
    awaited, not given up on for shard 0's replicas, which are still down."""
    import shared.shards.client as shards_client
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.model.placement import Placement
    from shared.shards.client import STALLS, ExpertsClient
    from shared.shards.remote_ffn import ffn_kinds

    save_tiny(tmp_path, "deepseek_v3")
    placement = Placement(2, 8, {1: tuple((0, 1) for _ in range(8))})
    procs, log, addresses = _start(tmp_path, placement)
    try:
        local = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64))
        client = ExpertsClient(addresses, placement, ffn_kinds(local.runner.model), timeout_s=60.0, retry_after_s=1.0)
        client.wait_ready(local.model_cfg, timeout_s=120)
        x, w = torch.randn(3, 64), torch.rand(3, 2)
        ids = torch.tensor([[0, 7], [3, 4], [6, 1]])
        with torch.inference_mode():
            want = local.runner.model.layers[1].mlp.backend.moe(1, x, ids, w)
            torch.testing.assert_close(client.run(1, x, ids, w), want, rtol=1e-5, atol=1e-6)
            procs[0].kill()
            procs[0].wait(timeout=30)
            torch.testing.assert_close(client.run(1, x, ids, w), want, rtol=1e-5, atol=1e-6)    # over to shard 1
            assert client._in_doubt == [True, False]

            # wide margins: stalled after 1 s, shard 0 avoided for 0.3 s, shard 1 thawed at 2 s, probed up to 5 s
            monkeypatch.setattr(shards_client, "STALL_FLOOR_S", 1.0)
            monkeypatch.setattr(shards_client, "PROBE_S", 5.0)
            stalls = _value(STALLS, "1")
            client._down_until[0] = time.monotonic() + 0.3
            procs[1].send_signal(signal.SIGSTOP)
            thaw = threading.Timer(2.0, procs[1].send_signal, (signal.SIGCONT,))
            thaw.start()
            try:
                got = client.run(1, x, ids, w)            # all to shard 1; its call outlives shard 0's avoidance
            finally:
                thaw.join()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert _value(STALLS, "1") == stalls
        client.close()
    finally:
        _stop(procs, log)
