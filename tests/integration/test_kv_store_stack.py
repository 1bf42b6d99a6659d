"""The KV block store through running stacks, with a real redis-server.

Shows: a prompt one target replica computed is served by the other with `cached_tokens` read from the store; a target
killed and restarted with an empty cache gets the prefix back from Redis; prefill/decode disaggregation (a prefill
target writes the prompt's blocks, the decode target reads them and decodes, with n-gram speculation, or with an
EAGLE draft service when the blocks are sent directly over gRPC) gives transformers' greedy tokens; the targets
export the store's metrics.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from tests.conftest import CHAT_PROMPTS, GREEDY_TOKENS, Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

SYSTEM = "You are a meticulous assistant for a library who answers in full sentences. " * 10


def ask(stub, question: str, system: str = SYSTEM, max_tokens: int = 4, k: int | None = None, salt: str = ""
        ) -> pb.GenerateResponse:
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    req = pb.GenerateRequest(messages=messages + [pb.ChatMessage(role="user", content=question)],
                             max_tokens=max_tokens, temperature=0, cache_salt=salt)
    if k is not None:
        req.num_speculative_tokens = k
    return stub.Generate(req, timeout=120)


class Busy:
    """A long stream on one replica, so that the router's next request goes to the other (least loaded)."""

    def __init__(self, stub) -> None:
        self.call = stub.GenerateStream(pb.GenerateRequest(prompt="Tell me a long story.", max_tokens=2000,
                                                           ignore_eos=True, temperature=0), timeout=300)
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()
        assert self.first.wait(60)

    def _drain(self) -> None:
        try:
            for _ in self.call:
                self.first.set()
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        self.call.cancel()
        self.thread.join(30)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_replicas_share_blocks_and_a_restarted_target_gets_them_back(redis, tmp_path):
    s = Stack(tmp_path, ["--anonymous-cached-tokens", "true", "--target-replicas", "2", "--kv-store", redis.url])
    try:
        s.wait_ready()
        with grpc.insecure_channel(s.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            expect = ask(stub, "Where are the maps?")                     # idle tie: replica 0 computes it
            assert expect.usage.cached_tokens == 0
            time.sleep(1.0)                                              # its blocks go to Redis in the background
            busy = Busy(stub)                                            # replica 0 busy: the next goes to 1
            other = ask(stub, "Where are the maps?")
            busy.stop()
            assert other.usage.cached_tokens >= 128                      # replica 1 never saw it: from Redis
            assert list(other.choices[0].token_ids) == list(expect.choices[0].token_ids)
            assert metric(s.metrics_port + 1, 'upesi_kv_store_hits_total{tier="redis"}') >= 8
            assert metric(s.metrics_port, 'upesi_kv_store_bytes_total{direction="write"}') > 0

            # replica 0 is killed and restarted by `upesi serve`: an empty cache, the prefix comes back from Redis
            port0 = min(s.target_pids())
            killed = s.target_pids()[port0]
            os.kill(killed, signal.SIGKILL)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                pids = s.target_pids()
                if pids.get(port0, killed) != killed and metric_ok(s.metrics_port):
                    break
                time.sleep(1)
            else:
                pytest.fail("replica 0 was not restarted")
            again = None
            for _ in range(40):                     # idle tie: replica 0, once the router has taken it back
                again = ask(stub, "Where are the maps?")
                if metric(s.metrics_port, "upesi_prefix_cache_queries_total") > 0:
                    break
                time.sleep(0.5)
            assert metric(s.metrics_port, 'upesi_kv_store_hits_total{tier="redis"}') >= 8
            assert list(again.choices[0].token_ids) == list(expect.choices[0].token_ids)
    finally:
        assert s.stop() == 0


def metric_ok(port: int) -> bool:
    try:
        metric(port, "upesi_kv_blocks_total")
        return True
    except OSError:
        return False


def greedy_equals(s: Stack, expect: list[list[int]], k: int | None = None) -> list[tuple[int, int]]:
    """The chat prompts' greedy tokens through the stack equal `expect`, the decode target with cached tokens ->
    each answer's (draft tokens, accepted tokens)."""
    spec = []
    with grpc.insecure_channel(s.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for prompt, ref in zip(CHAT_PROMPTS, expect):
            r = ask(stub, prompt, system="", max_tokens=GREEDY_TOKENS, k=k)
            assert list(r.choices[0].token_ids) == ref
            assert r.usage.cached_tokens >= 16
            spec.append((r.spec.draft_tokens, r.spec.accepted_tokens))
    return spec


def test_prefill_decode_disaggregation_equals_transformers(redis, hf_greedy, tmp_path):
    s = Stack(tmp_path, ["--anonymous-cached-tokens", "true", "--prefill-replicas", "1", "--kv-transfer", "store",
                         "--kv-store", redis.url,
                         "--speculative", "ngram"])
    try:
        s.wait_ready()
        greedy_equals(s, hf_greedy)
        decode, prefill = s.metrics_port, s.metrics_port + 1
        assert metric(decode, 'upesi_kv_store_hits_total{tier="redis"}') >= len(CHAT_PROMPTS)
        assert metric(decode, "upesi_spec_draft_tokens_total") > 0             # speculation on the decode side
        assert metric(prefill, 'upesi_kv_store_bytes_total{direction="write"}') > 0
        # The prefill target dies: requests are still answered, the decode target computing the prompts itself.
        os.kill(s.target_pids()[max(s.target_pids())], signal.SIGKILL)
        with grpc.insecure_channel(s.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for prompt in CHAT_PROMPTS[:2]:
                r = ask(stub, prompt + " Answer briefly.", system="", max_tokens=GREEDY_TOKENS)
                assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    finally:
        assert s.stop() == 0


def test_prefill_decode_with_direct_transfer_equals_transformers(hf_greedy, tmp_path):
    """No store: the prefill target sends the prompt's blocks, with the hidden-state rows an EAGLE head reads, to
    the decode target's host tier (PutBlocks); the decode target verifies an EAGLE draft service's trees, and they
    are the trees a single target gives (received blocks whose hidden rows were noise drafted differently)."""
    s = Stack(tmp_path, ["--anonymous-cached-tokens", "true", "--prefill-replicas", "1",   # direct transfer
                         "--draft", "eagle:models/eagle-smollm2-135m"])
    try:
        s.wait_ready()
        sent = greedy_equals(s, hf_greedy, k=4)
        decode, prefill = s.metrics_port, s.metrics_port + 1
        # the chat template's first block is shared: after the first prompt, one block a prompt comes from the host
        assert metric(decode, 'upesi_kv_store_hits_total{tier="host"}') >= len(CHAT_PROMPTS)
        assert metric(decode, 'upesi_kv_store_bytes_total{direction="received"}') > 0
        assert metric(prefill, 'upesi_kv_store_bytes_total{direction="sent"}') > 0
        # the draft service's trees were verified on the decode target, and some of them accepted
        assert sum(a for _, a in sent) > 0
    finally:
        assert s.stop() == 0
    # The head read the prompts' hidden states from the transferred blocks: a single target computing every prompt
    # itself drafts and accepts exactly as many tokens for every answer.
    (tmp_path / "single").mkdir()
    s = Stack(tmp_path / "single", ["--anonymous-cached-tokens", "true", "--draft", "eagle:models/eagle-smollm2-135m"])
    try:
        s.wait_ready()
        with grpc.insecure_channel(s.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            local = []
            for prompt, ref in zip(CHAT_PROMPTS, hf_greedy):
                r = ask(stub, prompt, system="", max_tokens=GREEDY_TOKENS, k=4)
                assert list(r.choices[0].token_ids) == ref
                local.append((r.spec.draft_tokens, r.spec.accepted_tokens))
        assert local == sent
    finally:
        assert s.stop() == 0
