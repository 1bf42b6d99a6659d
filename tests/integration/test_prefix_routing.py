"""Two target replicas behind one router, a real redis-server as the prefix-block registry.

Shows: the router sends a prompt to the replica that already holds its prefix (usage.cached_tokens), serving goes
on while Redis is down (routing by load), the index fills again when Redis returns, targets export the KV and
prefix-cache metrics, and no KV block stays in use afterwards.
"""
from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from tests.conftest import Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

SYSTEM_A = "You are a meticulous assistant for a library. " * 12
SYSTEM_B = "You are a cheerful cooking coach who answers briefly. " * 12


@pytest.fixture(scope="module")
def two(redis, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack2"), ["--anonymous-cached-tokens", "true", "--target-replicas", "2",
                                                  "--registry", redis.url])
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0


def ask(stub, system: str, question: str, **kw) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="system", content=system),
                                                      pb.ChatMessage(role="user", content=question)],
                                            max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw), timeout=120)


def target_ports(stack: Stack) -> list[int]:
    text = stack.log.read_text()
    return sorted({int(line.split(" on 127.0.0.1:")[1]) for line in text.splitlines()
                   if "serving upesi.v1.Target on" in line})


def test_routing_follows_the_cached_prefix(two, redis):
    with grpc.insecure_channel(two.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        assert ask(stub, SYSTEM_A, "Hi").usage.cached_tokens == 0            # idle tie: replica 0
        # keep replica 0 busy so that SYSTEM_B's first request lands on replica 1
        busy = stub.GenerateStream(pb.GenerateRequest(prompt="Tell me a long story.", max_tokens=400,
                                                      ignore_eos=True, temperature=0), timeout=300)
        first = threading.Event()

        def drain() -> None:
            try:
                for _ in busy:
                    first.set()
            except grpc.RpcError:          # cancelled below
                pass
        t = threading.Thread(target=drain, daemon=True)
        t.start()
        assert first.wait(60)
        assert ask(stub, SYSTEM_B, "Hi").usage.cached_tokens == 0
        busy.cancel()
        t.join(30)
        # Both replicas idle again. Load alone would pick replica 0; the registry knows SYSTEM_B lives on replica 1.
        deadline = time.monotonic() + 10
        while True:
            cached = ask(stub, SYSTEM_B, "How do I boil an egg?").usage.cached_tokens
            if cached or time.monotonic() > deadline:
                break
            time.sleep(0.2)                                                  # publisher batches every 50 ms
        assert cached >= 64
        assert ask(stub, SYSTEM_A, "Where are the maps?").usage.cached_tokens >= 64

        # Redis goes away: serving goes on, routed by load.
        redis.stop()
        r = ask(stub, SYSTEM_B, "And scrambled eggs?")
        assert len(r.choices[0].token_ids) == 4
        redis.restart()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:                                   # publishers re-register their sets
            if ask(stub, SYSTEM_B, "Poached?").usage.cached_tokens >= 64:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the index did not fill again after Redis came back")


def test_metrics_and_no_leaked_blocks(two):
    ports = target_ports(two)
    assert len(ports) == 2
    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            load = target_pb2_grpc.TargetStub(ch).Load(target_pb2.LoadRequest(), timeout=10)
            assert load.kv_blocks_used == 0 and load.running == 0 and load.waiting == 0
    metrics = [urllib.request.urlopen(f"http://127.0.0.1:{two.metrics_port + i}/metrics").read().decode()
               for i in range(2)]
    for text in metrics:
        for name in ("upesi_kv_blocks_total", "upesi_kv_blocks_used", "upesi_prefix_cache_queries_total",
                     "upesi_prefix_cache_hits_total", "upesi_preemptions_total"):
            assert name in text
    hits = [float(line.split()[-1]) for text in metrics for line in text.splitlines()
            if line.startswith("upesi_prefix_cache_hits_total")]
    assert sum(hits) >= 64 * 3


def test_a_killed_replica_is_routed_around_and_restarted(two):
    """kill -9 of one target: every following request is served (by the other replica, the dead one marked down
    after its first refusal); `upesi serve` restarts it, and once it is back the router uses it again, shown by
    killing the other one next."""
    import os
    import signal

    with grpc.insecure_channel(two.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for victim_port in target_ports(two):
            pids = two.target_pids()
            os.kill(pids[victim_port], signal.SIGKILL)
            for i in range(8):                              # while it is down or restarting
                r = ask(stub, SYSTEM_A, f"Name {i + 2} books.", max_tokens=3)
                assert r.usage.completion_tokens == 3
            deadline = time.monotonic() + 240               # the launcher restarts it; it loads and serves again
            while time.monotonic() < deadline:
                back = two.target_pids().get(victim_port)
                if back not in (None, pids[victim_port]):
                    try:
                        with grpc.insecure_channel(f"127.0.0.1:{victim_port}") as tch:
                            target_pb2_grpc.TargetStub(tch).Load(target_pb2.LoadRequest(), timeout=2)
                        break
                    except grpc.RpcError:
                        pass
                time.sleep(0.5)
            else:
                pytest.fail(f"the target on port {victim_port} did not come back:\n{two.log.read_text()[-2000:]}")
            time.sleep(5.5)                                  # past the router's hold-off for the replica
        assert two.proc.poll() is None and "restarting it" in two.log.read_text()
