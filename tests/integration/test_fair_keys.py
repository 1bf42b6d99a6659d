"""Fairness across API keys through the whole stack: one key floods the target (60 requests against 4 sequence
slots), another key's short request, sent after the flood, is admitted at the next free slot instead of behind the
flood, and is answered while most of the flood still waits."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.conftest import Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

FLOOD, QUIET = "sk-flood-93c1aa", "sk-quiet-4e07b2"
KEYS = f"keys:\n  - {{name: flood, key: {FLOOD}}}\n  - {{name: quiet, key: {QUIET}}}\n"
FLOOD_REQUESTS = 60


def ask(stub, key: str, tokens: int) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Tell me about rivers.")],
                                            temperature=0, max_tokens=tokens, ignore_eos=True),
                         metadata=[("authorization", f"Bearer {key}")], timeout=600)


def test_a_keys_flood_does_not_queue_another_keys_request_behind_it(tmp_path, monkeypatch):
    (tmp_path / "keys.yaml").write_text(KEYS)
    monkeypatch.setenv("UPESI_API_KEYS_FILE", str(tmp_path / "keys.yaml"))
    stack = Stack(tmp_path, ["--max-num-seqs", "4"])
    try:
        stack.wait_ready()
        with grpc.insecure_channel(stack.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            done: list[str] = []
            lock = threading.Lock()

            def run(key: str, tokens: int, name: str) -> None:
                ask(stub, key, tokens)
                with lock:
                    done.append(name)
            flood = [threading.Thread(target=run, args=(FLOOD, 32, "flood")) for _ in range(FLOOD_REQUESTS)]
            for t in flood:
                t.start()
            time.sleep(1.0)                                  # the flood is queued at the target
            t0 = time.perf_counter()
            run(QUIET, 4, "quiet")
            quiet_s = time.perf_counter() - t0
            for t in flood:
                t.join()
        before = done.index("quiet")
        print(f"quiet answered in {quiet_s:.2f} s, after {before} of {FLOOD_REQUESTS} flood requests")
        assert len(done) == FLOOD_REQUESTS + 1
        assert before < FLOOD_REQUESTS // 4              # first come, first served would put it after all 60
    finally:
        assert stack.stop() == 0, stack.log.read_text()[-3000:]
