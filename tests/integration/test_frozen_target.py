"""A target replica frozen (SIGSTOP) in a two-replica stack: requests sent to it fail over to the other replica
once the router's keepalive finds it dead (UNAVAILABLE before anything reached the client), so every request is
answered, as plain decoding answers it; after it thaws (SIGCONT) both replicas serve again."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import grpc
import pytest

from tests.conftest import CHAT_PROMPTS, Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow


def request(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=CHAT_PROMPTS[i % len(CHAT_PROMPTS)])],
                              temperature=0, max_tokens=24, ignore_eos=True)


def test_requests_fail_over_from_a_frozen_target(tmp_path):
    stack = Stack(tmp_path, ["--target-replicas", "2", "--target-metrics-port", "0"])
    try:
        stack.wait_ready()
        pids = stack.target_pids()
        assert len(pids) == 2
        with grpc.insecure_channel(stack.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            want = [list(stub.Generate(request(i), timeout=300).choices[0].token_ids) for i in range(8)]
            frozen = next(iter(pids.values()))
            os.kill(frozen, signal.SIGSTOP)
            try:
                with cf.ThreadPoolExecutor(8) as pool:
                    got = list(pool.map(lambda i: list(stub.Generate(request(i), timeout=120).choices[0].token_ids),
                                        range(8)))
                assert got == want
            finally:
                os.kill(frozen, signal.SIGCONT)
            again = [list(stub.Generate(request(i), timeout=300).choices[0].token_ids) for i in range(8)]
            assert again == want
        log = stack.log.read_text()
        assert "trying another replica" in log and "too_many_pings" not in log
    finally:
        assert stack.stop() == 0, stack.log.read_text()[-3000:]
