"""Expert shards as real processes: `upesi serve --expert-shards N` on the default (dense) model, whose FFNs are split
by intermediate neurons across the shards, and a tiny DeepSeek-V3 (dense + MoE layers, shared experts) whose routed
experts run on two `upesi experts` processes under an in-process engine.

Shows: greedy output equals the in-process engine; exactly one Dispatch per shard per layer per forward step whatever
the batch; a killed shard gives the client UNAVAILABLE within the shard deadline and leaks no KV block, and serves
again once restarted; replicas take over for a dead shard; LoadExperts adds replicas without a restart.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch

from tests.conftest import CHAT_PROMPTS, INTERNAL, ROOT, Stack, free_port, free_port_run
from upesi.v1 import experts_pb2, experts_pb2_grpc, generation_pb2_grpc, target_pb2, target_pb2_grpc
from upesi.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

TOKENS = 32
NUM_LAYERS = 30                                           # SmolLM2-135M
BATCH = ["What is the capital of Italy?", "Give me a synonym for happy.", "Count from one to ten.",
         "Why is the sky blue?", "Write a haiku about rain.", "What is 12 times 12?",
         "Describe a cat in one sentence.", "Translate 'good morning' to French."]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}shards")
def stack(request, tmp_path_factory):
    n = request.param
    target_port = free_port_run(n + 1)
    s = Stack(tmp_path_factory.mktemp(f"experts{n}"),
              ["--expert-shards", str(n), "--target-address", f"127.0.0.1:{target_port}"])
    s.num_shards, s.target_address = n, f"127.0.0.1:{target_port}"
    s.shard_addresses = [f"127.0.0.1:{target_port + 1 + i}" for i in range(n)]
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def reference(engine, chat_prompt_ids) -> list[list[int]]:
    """The in-process engine's greedy continuations of the first two chat prompts."""
    from shared.sampling_params import SamplingParams
    return [o[0] for o in engine.generate(chat_prompt_ids[:2], SamplingParams(temperature=0, max_tokens=TOKENS))]


def chat(text: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], temperature=0, **kw)


def scrape(stack) -> tuple[float, dict[str, float]]:
    """(forward steps, OK Dispatch RPCs per shard) from the target's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
    steps, rpcs = 0.0, {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "upesi_engine_step_seconds_count":
                steps = s.value
            elif s.name == "upesi_expert_rpcs_total" and s.labels["code"] == "OK":
                rpcs[s.labels["shard"]] = s.value
    assert "upesi_expert_tokens_total" in text and "upesi_expert_rpc_seconds_bucket" in text
    return steps, rpcs


def settled(stack) -> tuple[float, dict[str, float]]:
    """Metrics once the last step's observer has run (a reply can overtake it)."""
    last = scrape(stack)
    for _ in range(20):
        time.sleep(0.25)
        now = scrape(stack)
        if now == last:
            return now
        last = now
    return last


def test_greedy_through_sharded_ffns_equals_the_in_process_engine(stub, reference):
    for prompt, want in zip(CHAT_PROMPTS[:2], reference):
        r = stub.Generate(chat(prompt, max_tokens=TOKENS), timeout=300)
        assert list(r.choices[0].token_ids) == want


def test_one_dispatch_per_shard_per_layer_per_step_whatever_the_batch(stack, stub):
    for batch in (BATCH[:1], BATCH):
        steps0, rpcs0 = settled(stack)
        with cf.ThreadPoolExecutor(len(batch)) as ex:
            list(ex.map(lambda p: stub.Generate(chat(p, max_tokens=12, ignore_eos=True), timeout=300), batch))
        steps1, rpcs1 = settled(stack)
        steps = steps1 - steps0
        assert steps >= 12
        assert {s: rpcs1[s] - rpcs0.get(s, 0) for s in rpcs1} == \
            {str(s): NUM_LAYERS * steps for s in range(stack.num_shards)}, f"{len(batch)} requests, {steps} steps"
    with grpc.insecure_channel(stack.shard_addresses[0]) as ch:      # the shard counts the same calls
        info = experts_pb2_grpc.ExpertsStub(ch).Info(experts_pb2.ShardInfoRequest(), timeout=10,
                                                              metadata=INTERNAL)
    assert info.dispatches == rpcs1["0"] and info.held == NUM_LAYERS and info.num_shards == stack.num_shards


@pytest.mark.parametrize("stack", [3], indirect=True, ids=["3shards"])
def test_shard_loads_units_on_demand_and_rejects_bad_input(stack):
    """Shard 0 loads slice 1 of layer 0 (shard 1's) from the checkpoint; both then compute it identically."""
    from shared import tensor_codec

    def pb_tensor(t):
        dtype, shape, data = tensor_codec.encode(t)
        return experts_pb2.Tensor(dtype=dtype, shape=shape, data=data)

    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0))
    req = experts_pb2.DispatchRequest(layer=0, hidden=pb_tensor(x),
                                      expert_ids=pb_tensor(torch.ones(4, dtype=torch.int32)))
    with grpc.insecure_channel(stack.shard_addresses[0]) as c0, grpc.insecure_channel(stack.shard_addresses[1]) as c1:
        s0, s1 = experts_pb2_grpc.ExpertsStub(c0), experts_pb2_grpc.ExpertsStub(c1)
        with pytest.raises(grpc.RpcError) as e:                 # a caller outside the deployment
            s0.LoadExperts(experts_pb2.LoadExpertsRequest(experts=[experts_pb2.ExpertRef(layer=0, expert=1)]),
                           timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            s0.Dispatch(req, timeout=10, metadata=INTERNAL)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "LoadExperts" in e.value.details()
        r = s0.LoadExperts(experts_pb2.LoadExpertsRequest(experts=[experts_pb2.ExpertRef(layer=0, expert=1)]),
                           timeout=120, metadata=INTERNAL)
        assert (r.loaded, r.held) == (1, NUM_LAYERS + 1)
        a = s0.Dispatch(req, timeout=10, metadata=INTERNAL).output
        b = s1.Dispatch(req, timeout=10, metadata=INTERNAL).output
        assert a.data == b.data and list(a.shape) == [4, 576]
        short = experts_pb2.Tensor(dtype="float32", shape=[4, 576], data=b"x")
        bad = experts_pb2.DispatchRequest(layer=0, hidden=short, expert_ids=req.expert_ids)
        with pytest.raises(grpc.RpcError) as e:
            s1.Dispatch(bad, timeout=10, metadata=INTERNAL)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden" in e.value.details()
        assert "Traceback" not in e.value.details()


def _shard_pids(stack) -> dict[int, int]:
    pids = {}
    for m in re.finditer(r"upesi: expert shard (\d+) on \S+ \(pid (\d+)\)", stack.log.read_text()):
        pids[int(m[1])] = int(m[2])
    return pids


@pytest.mark.parametrize("stack", [2], indirect=True, ids=["2shards"])
def test_killed_shard_fails_the_stream_fast_frees_its_blocks_and_serves_again_when_restarted(stack, stub, reference):
    victim = stack.num_shards - 1
    pid = _shard_pids(stack)[victim]
    # the stream's own deadline is far past the shard's (5 s): UNAVAILABLE naming the shard, not DEADLINE_EXCEEDED,
    # shows that the target gave up on the shard rather than the client on the stream
    stream = stub.GenerateStream(chat("Tell me a long story about a lighthouse.", max_tokens=400, ignore_eos=True),
                                 timeout=60)
    next(stream), next(stream)                                       # decoding has started
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "expert shard" in e.value.details()
    with grpc.insecure_channel(stack.target_address) as ch:
        target = target_pb2_grpc.TargetStub(ch)
        deadline = time.monotonic() + 10
        while (load := target.Load(target_pb2.LoadRequest(), timeout=10)).kv_blocks_used:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (load.kv_blocks_used, load.running, load.waiting) == (0, 0, 0)
    # `upesi serve` restarts the shard; the target's channel reconnects to it
    deadline = time.monotonic() + 180
    while True:
        try:
            r = stub.Generate(chat(CHAT_PROMPTS[0], max_tokens=TOKENS), timeout=120)
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert time.monotonic() < deadline, stack.log.read_text()[-3000:]
            time.sleep(1)
    assert _shard_pids(stack)[victim] != pid
    assert list(r.choices[0].token_ids) == reference[0]


# ---------------------------------------------------------------- routed experts: a tiny DeepSeek-V3
def _start_shard(model: str, index: int, n: int, address: str, placement: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "experts", "--model", model, "--address", address,
                             "--shard-index", str(index), "--num-shards", str(n), "--expert-placement", placement,
                             "--num-threads", "1"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def test_routed_experts_on_shards_equal_local_with_replicas_fail_over_and_rebalancing(tmp_path):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.errors import PeerUnavailable
    from shared.model.placement import Placement
    from shared.sampling_params import SamplingParams
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds
    from shared.shards.rebalance import replicate_hot
    from shared.testing.moe_checkpoints import save_tiny

    save_tiny(tmp_path, "deepseek_v3")                   # layer 0 dense; layers 1, 2: 8 routed + 1 shared expert
    # layer 1: every expert on both shards; layer 2: contiguous. Dense layer 0: slice 1 also on shard 0.
    placement = Placement(2, 8, {1: tuple((0, 1) for _ in range(8)), 0: ((0,), (1, 0))})
    placement.save(str(tmp_path / "placement.json"))
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    log = open(tmp_path / "shards.log", "w")
    procs = [_start_shard(str(tmp_path), i, 2, a, str(tmp_path / "placement.json"), log)
             for i, a in enumerate(addresses)]
    try:
        def engine():
            return LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64))
        local, remote = engine(), engine()
        prompts = [[5, 17, 29, 3, 77, 41, 8], [9, 2, 64, 13]]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        want = local.generate(prompts, params)
        scored = torch.arange(1, 40).tolist()
        want_logits = local.score(scored)

        model = remote.runner.model
        client = ExpertsClient(addresses, placement, ffn_kinds(model), timeout_s=5.0)
        assert client.dense_layers == [True, False, False]
        client.wait_ready(remote.model_cfg, timeout_s=120)
        assert attach_expert_shards(model, client) > 0
        assert remote.generate(prompts, params) == want
        torch.testing.assert_close(remote.score(scored), want_logits, rtol=1e-5, atol=1e-5)
        seen = client.tokens[True][0, 0]                            # tokens through layer 0 (every slice sees all)
        assert seen > 0 and client.tokens[False].sum(dim=1).tolist() == [0, 2 * seen, 2 * seen]   # top-2

        # EPLB: replicate the hottest experts of layer 2 from the measured load; the shards load them on demand
        new = replicate_hot(client.tokens[False], placement, extra=2, layers=[2])
        loaded = client.apply_placement(new)
        assert sum(loaded.values()) == 2
        assert remote.generate(prompts, params) == want

        # shard 1 dies: layer 0's slices and layer 1's experts have replicas on shard 0, most of layer 2's do not
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        with torch.inference_mode():
            x = torch.randn(3, 64)
            dense = model.layers[0].mlp(x)                          # slice 1 fails over to shard 0
            ids = torch.tensor([[0, 7], [3, 4], [6, 1]])
            w = torch.rand(3, 2)
            got = client.run(1, x, ids, w)                          # experts 4..7 fail over to shard 0
            assert client._avoid() == {1}
            # the same where shard 1's avoid window has run out by the retry (the other shards' replies took
            # longer than retry_after_s): the retry still goes to the shard that answered
            brief = ExpertsClient(addresses, placement, ffn_kinds(model), timeout_s=5.0, retry_after_s=0.0)
            torch.testing.assert_close(brief.run(1, x, ids, w), got, rtol=0, atol=0)
            brief.close()
            lonely = [e for e in range(8) if new.shards(2, e, dense=False) == (1,)][:2]
            with pytest.raises(PeerUnavailable, match="no replica"):    # refused at once, not after a deadline
                client.run(2, x, torch.tensor([lonely] * 3), w)     # experts on shard 1 only
        local_model = local.runner.model
        with torch.inference_mode():
            torch.testing.assert_close(dense, local_model.layers[0].mlp(x), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, local_model.layers[1].mlp.backend.moe(1, x, ids, w), rtol=1e-5, atol=1e-6)
        client.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        log.close()
    print(json.dumps({"rpcs": client.num_rpcs, "bytes_sent": client.bytes_sent}))
