"""Faults mid-stream against the whole stack at once: redis + draft service + 2 expert shards + target + router.

One `upesi serve` runs everything on the default model, as in production but on free ports. Each test breaks one
part while a greedy stream is open and checks the behaviour docs/architecture.md (Invariants) defines, then that the
target holds no KV block afterwards:
- kill an expert shard -> the stream ends with UNAVAILABLE promptly; `upesi serve` restarts the shard, serving resumes;
- kill the draft        -> the stream completes with exactly the non-speculative tokens, no error;
- stop Redis            -> the stream completes unchanged; new requests are still served (routing falls back to load);
- cancel the client     -> its KV blocks are freed within a step or two;
- SIGTERM the router    -> the in-flight stream finishes whole; a new request gets UNAVAILABLE.
The tests run in file order and share the stack; each leaves it serving for the next.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from shared.testing.redis_server import RedisServer
from tests.conftest import INTERNAL_TOKEN, ROOT, Stack, free_port
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."
TOKENS = 40


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the direct children of `pid` (from /proc; no psutil needed)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _child_pid(stack: Stack, role: str) -> int:
    pids = [pid for pid, cmd in _children(stack.proc.pid).items() if f"services.cli {role} " in cmd]
    assert pids, f"no {role} child of upesi serve: {_children(stack.proc.pid)}"
    return pids[0]


@pytest.fixture(scope="module")
def full_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    redis = RedisServer(tmp / "redis").start()
    target_port = free_port()
    stack = Stack(tmp, ["--registry", redis.url, "--expert-shards", "2", "--draft", "ngram",
                        "--draft-address", f"127.0.0.1:{free_port()}", "--num-speculative-tokens", "4",
                        "--target-address", f"127.0.0.1:{target_port}", "--kv-cache-gb", "0.25"])
    stack.target_address = f"127.0.0.1:{target_port}"
    stack.redis = redis
    try:
        stack.wait_ready()
        yield stack
    finally:
        code = stack.stop()
        redis.stop()
        assert code == 0, stack.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def stub(full_stack):
    with grpc.insecure_channel(full_stack.address) as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


def request(**kw) -> pb.GenerateRequest:
    kw = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **kw}
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=PROMPT)], **kw)


@pytest.fixture(scope="module")
def reference(stub) -> list[int]:
    """The greedy tokens without speculation, from the same stack (which other tests compare with transformers)."""
    r = stub.Generate(request(num_speculative_tokens=0), timeout=180)
    assert len(r.choices[0].token_ids) == TOKENS and r.spec.draft_tokens == 0
    return list(r.choices[0].token_ids)


def assert_no_blocks_held(stack: Stack, within_s: float = 10.0) -> None:
    with grpc.insecure_channel(stack.target_address) as ch:
        target = target_pb2_grpc.TargetStub(ch)
        deadline = time.monotonic() + within_s
        while (load := target.Load(target_pb2.LoadRequest(), timeout=10)).kv_blocks_used and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert (load.kv_blocks_used, load.running, load.waiting) == (0, 0, 0)


def stream_tokens(stream) -> list[int]:
    return [t for msg in stream for c in msg.choices for t in c.token_ids]


def generate_when_back(stub, stack: Stack, timeout_s: float = 180.0) -> pb.GenerateResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return stub.Generate(request(), timeout=120)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            assert time.monotonic() < deadline, stack.log.read_text()[-3000:]
            time.sleep(1)


def test_speculative_stream_with_shards_equals_non_speculative(stub, full_stack, reference):
    r = stub.Generate(request(), timeout=180)
    assert list(r.choices[0].token_ids) == reference
    assert r.spec.draft_tokens > 0                          # the draft service took part
    assert_no_blocks_held(full_stack)


def test_kill_expert_shard_mid_stream(stub, full_stack, reference):
    victim = _child_pid(full_stack, "experts")
    stream = stub.GenerateStream(request(), timeout=180)
    next(stream)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as e:
        stream_tokens(stream)
    # the shard's failure, not the request's deadline (180 s, which would read DEADLINE_EXCEEDED)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "Traceback" not in e.value.details()
    assert_no_blocks_held(full_stack)
    r = generate_when_back(stub, full_stack)                  # `upesi serve` restarted the shard
    assert list(r.choices[0].token_ids) == reference
    assert victim not in _children(full_stack.proc.pid)
    assert_no_blocks_held(full_stack)


def test_kill_draft_mid_stream(stub, full_stack, reference):
    victim = _child_pid(full_stack, "draft")
    stream = stub.GenerateStream(request(), timeout=180)
    tokens = list(next(stream).choices[0].token_ids)
    os.kill(victim, signal.SIGKILL)
    tokens += stream_tokens(stream)                           # no error: the target goes on alone
    assert tokens == reference
    assert_no_blocks_held(full_stack)


def test_stop_redis_mid_stream(stub, full_stack, reference):
    stream = stub.GenerateStream(request(), timeout=180)
    tokens = list(next(stream).choices[0].token_ids)
    full_stack.redis.stop()
    try:
        tokens += stream_tokens(stream)
        assert tokens == reference
        r = stub.Generate(request(), timeout=180)             # routing falls back to load
        assert list(r.choices[0].token_ids) == reference
        assert_no_blocks_held(full_stack)
    finally:
        full_stack.redis.restart()


def test_cancel_client_mid_stream_frees_blocks(stub, full_stack):
    stream = stub.GenerateStream(request(max_tokens=400), timeout=180)
    next(stream), next(stream)
    stream.cancel()
    assert_no_blocks_held(full_stack, within_s=5.0)


def test_sigterm_router_drains_in_flight_and_refuses_new(full_stack, reference, tmp_path):
    """A second router in front of the same target, so that stopping it leaves the stack up for the leak check."""
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen([sys.executable, "-m", "services.cli", "router", "--address", address,
                               "--target", full_stack.target_address, "--http-port", "0"], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "UPESI_INTERNAL_TOKEN": INTERNAL_TOKEN})
    try:
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
            stub = generation_pb2_grpc.GenerationStub(ch)
            stub.Generate(request(max_tokens=1), timeout=120)     # the router has met the target
            stream = stub.GenerateStream(request(), timeout=180)
            tokens = list(next(stream).choices[0].token_ids)
            router.send_signal(signal.SIGTERM)
            tokens += stream_tokens(stream)                        # the in-flight stream drains
            assert tokens == reference
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(request(max_tokens=4), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert router.wait(timeout=60) == 0
    finally:
        if router.poll() is None:
            router.kill()
    assert_no_blocks_held(full_stack)
