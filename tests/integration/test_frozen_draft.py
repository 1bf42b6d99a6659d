"""A draft service frozen (SIGSTOP) under a speculative request: the router stops waiting for it and takes the
request over on the target, which decodes on without drafts; the client's stream goes on without a gap or a
repeated token and equals plain decoding; requests while it stays frozen are served without it; once it thaws
(SIGCONT), requests draft again."""
from __future__ import annotations

import os
import signal
import time

import grpc
import psutil
import pytest

from tests.conftest import CHAT_PROMPTS
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow


def request(k: int, max_tokens: int = 160) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=CHAT_PROMPTS[2])], temperature=0,
                              max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)


def test_a_frozen_draft_costs_a_stall_not_the_request(spec_stack):
    draft = next(p for p in psutil.Process(spec_stack.proc.pid).children()
                 if "draft" in p.cmdline() and "--proposer" in p.cmdline())
    with grpc.insecure_channel(spec_stack.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        plain = stub.Generate(request(0), timeout=300).choices[0]
        try:
            ids, frozen, gaps, last = [], False, [], 0.0
            for msg in stub.GenerateStream(request(4), timeout=300):
                now = time.perf_counter()
                if frozen:
                    gaps.append(now - last)
                last = now
                for c in msg.choices:
                    ids += c.token_ids
                if len(ids) >= 20 and not frozen:
                    os.kill(draft.pid, signal.SIGSTOP)
                    frozen = True
            assert frozen and ids == list(plain.token_ids)          # handed over: no gap, no repeat
            print(f"longest wait for output after the freeze: {max(gaps):.2f} s")
            while_frozen = stub.Generate(request(4, 40), timeout=300)
            assert list(while_frozen.choices[0].token_ids) == list(plain.token_ids[:40])
        finally:
            os.kill(draft.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        drafted = 0
        while not drafted and time.monotonic() < deadline:          # the router retries the draft after a while
            r = stub.Generate(request(4, 40), timeout=300)
            assert list(r.choices[0].token_ids) == list(plain.token_ids[:40])
            drafted = r.spec.draft_tokens
            time.sleep(0.5)
        assert drafted > 0
