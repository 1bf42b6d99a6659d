"""Graceful drain: SIGTERM to the router while a gRPC and an HTTP stream are open. Both finish whole, a new gRPC
request gets UNAVAILABLE, a new HTTP request 503, and the router exits cleanly (which makes `upesi serve` stop the
rest of the stack)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

TOKENS = 160          # long enough that both streams are still open after the SIGTERM and the checks


def child_pid(parent: int, command: str) -> int:
    """The pid of parent's child process whose command line runs `services.cli <command>` (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue                                     # it exited while we looked
        if ppid == parent and b"services.cli" in argv and command.encode() in argv:
            return int(entry.name)
    raise LookupError(f"no `{command}` child of {parent}")


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(tmp_path):
    stack = Stack(tmp_path)
    try:
        stack.wait_ready()
        router = child_pid(stack.proc.pid, "router")
        with grpc.insecure_channel(stack.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            req = pb.GenerateRequest(prompt="The alphabet:", max_tokens=TOKENS, temperature=0, ignore_eos=True)
            whole = stub.Generate(req, timeout=120).choices[0]
            reference = list(whole.token_ids)
            web = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=120)
            web.request("POST", "/v1/completions", json.dumps({"prompt": req.prompt, "max_tokens": TOKENS,
                        "temperature": 0, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
            answer = web.getresponse()
            events = [answer.readline()]                 # the HTTP stream is in flight ...
            stream = stub.GenerateStream(req, timeout=120)
            msgs = [next(stream)]                        # ... and so is the gRPC one
            os.kill(router, signal.SIGTERM)
            time.sleep(0.5)                              # the router's loop handles the signal
            with grpc.insecure_channel(stack.address) as fresh:     # a new connection, as a new client makes
                with pytest.raises(grpc.RpcError) as refused:
                    generation_pb2_grpc.GenerationStub(fresh).Generate(
                        pb.GenerateRequest(prompt="Hi", max_tokens=1), timeout=30)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value.details()
            late = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)   # HTTP refuses too
            late.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}),
                         {"Content-Type": "application/json"})
            refused_http = late.getresponse()
            assert refused_http.status == 503, refused_http.read()
            assert "shutting down" in json.loads(refused_http.read())["error"]["message"]
            late.close()
            msgs += list(stream)                         # the open streams go on to their ends
            events += answer.read().splitlines()
            web.close()
        tokens = [t for m in msgs for c in m.choices for t in c.token_ids]
        assert tokens == reference and len(tokens) == TOKENS
        assert msgs[-1].choices[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == TOKENS
        data = [e[len(b"data: "):] for e in events if e.startswith(b"data: ")]
        assert data[-1] == b"[DONE]", events
        chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
        assert "".join(c["text"] for c in chunks) == whole.text and chunks[-1]["finish_reason"] == "length"
        assert stack.proc.wait(timeout=60) == 1          # serve stops the stack once a service has exited ...
        assert "a service exited (code 0)" in stack.log.read_text()   # ... and the router exited cleanly
    finally:
        if stack.proc.poll() is None:
            stack.stop()
