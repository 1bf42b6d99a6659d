"""Speculative decoding across processes: router -> draft service, which drives a Verify stream to the target.

Greedy output equals transformers' (and so non-speculative) output; speculation is used and counted; if the draft
dies mid-request the router attaches to the request on the target, which finishes it without speculation and
without an error; no KV block leaks.
"""
from __future__ import annotations

import signal
import time
import urllib.request

import grpc
import pytest

from shared.testing.stack import spawn, wait_healthy
from tests.conftest import CHAT_PROMPTS, GREEDY_TOKENS, free_port
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("spec") / "stack.log", "w")
    draft, target, router = (f"127.0.0.1:{free_port()}" for _ in range(3))
    metrics, draft_metrics = free_port(), free_port()
    procs = {"draft": spawn(["draft", "--address", draft, "--proposer", "ngram", "--metrics-port",
                             str(draft_metrics)], log)}
    procs["target"] = spawn(["target", "--address", target, "--num-speculative-tokens", "4",
                             "--metrics-port", str(metrics), "--kv-cache-gb", "0.25"], log)
    procs["router"] = spawn(["router", "--address", router, "--target", target, "--draft", draft,
                             "--http-port", "0"], log)
    try:
        wait_healthy(router)
        yield {"router": router, "target": target, "draft": draft, "metrics": metrics,
               "draft_metrics": draft_metrics, "procs": procs}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)


def chat(text: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], **kw)


def test_greedy_speculative_equals_transformers(spec_stack, hf_greedy):
    with grpc.insecure_channel(spec_stack["router"]) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        drafted = 0
        for prompt, ref in zip(CHAT_PROMPTS, hf_greedy):
            r = stub.Generate(chat(prompt, max_tokens=GREEDY_TOKENS, temperature=0), timeout=120)
            assert list(r.choices[0].token_ids) == ref
            drafted += r.spec.draft_tokens
            assert r.spec.accepted_tokens <= r.spec.draft_tokens
        assert drafted > 0
        off = stub.Generate(chat(CHAT_PROMPTS[0], max_tokens=16, temperature=0, num_speculative_tokens=0), timeout=60)
        assert off.spec.draft_tokens == 0 and list(off.choices[0].token_ids) == hf_greedy[0][:16]
    text = urllib.request.urlopen(f"http://127.0.0.1:{spec_stack['metrics']}/metrics").read().decode()
    assert "upesi_spec_draft_tokens_total" in text and "upesi_spec_accepted_tokens_total" in text
    # The draft exports its own families only (it imports modules that define the target's and router's).
    text = urllib.request.urlopen(f"http://127.0.0.1:{spec_stack['draft_metrics']}/metrics").read().decode()
    proposed = [line for line in text.splitlines() if line.startswith("upesi_draft_proposed_tokens_total ")]
    assert proposed and float(proposed[0].split()[1]) > 0
    assert "upesi_spec_draft_tokens" not in text and "upesi_requests_total" not in text
    assert "process_cpu_seconds_total" in text or "python_info" in text


def test_a_target_drafts_by_lookup_for_requests_without_a_draft(tmp_path):
    """--lookup-speculation: with no draft service at all, an answer that copies its prompt is drafted by prompt
    lookup in the target; greedy output equals the same stack's plain output, and a chat answer is unchanged."""
    log = open(tmp_path / "lookup.log", "w")
    target, router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [spawn(["target", "--address", target, "--num-speculative-tokens", "8", "--lookup-speculation", "true",
                    "--kv-cache-gb", "0.25"], log)]
    procs.append(spawn(["router", "--address", router, "--target", target, "--http-port", "0"], log))
    copy = ("Repeat this sentence twice, word for word: The quick brown fox jumps over the lazy dog near the "
            "river bank at dawn.")
    try:
        wait_healthy(router)
        with grpc.insecure_channel(router) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for prompt, drafts in ((copy, True), (CHAT_PROMPTS[1], None)):
                plain = stub.Generate(chat(prompt, max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True,
                                           num_speculative_tokens=0), timeout=120)
                r = stub.Generate(chat(prompt, max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True),
                                  timeout=120)
                assert plain.spec.draft_tokens == 0
                assert list(r.choices[0].token_ids) == list(plain.choices[0].token_ids)
                if drafts:
                    assert r.spec.draft_tokens > 0 and r.spec.accepted_tokens > 0, r.choices[0].text
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
        log.close()


def test_draft_refuses_targets_outside_its_allow_list(spec_stack, hf_greedy, tmp_path):
    """A draft started with --targets serves only those: asked for another target it answers PERMISSION_DENIED,
    and a router sending it requests for that target still serves them, without speculation."""
    from upesi.v1 import draft_pb2, draft_pb2_grpc

    log = open(tmp_path / "allow.log", "w")
    draft, router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [spawn(["draft", "--address", draft, "--proposer", "ngram", "--targets", "127.0.0.1:1"], log)]
    procs.append(spawn(["router", "--address", router, "--target", spec_stack["target"], "--draft", draft,
                        "--http-port", "0"], log))
    try:
        wait_healthy(draft)
        wait_healthy(router)
        with grpc.insecure_channel(draft) as ch:
            req = target_pb2.TargetGenerateRequest(request_id="allow-1", prompt_token_ids=[1, 2, 3],
                                                  sampling=target_pb2.SamplingParams(max_tokens=4))
            with pytest.raises(grpc.RpcError) as e:
                list(draft_pb2_grpc.DraftStub(ch).Generate(
                    draft_pb2.DraftGenerateRequest(target=spec_stack["target"], request=req), timeout=30))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
            assert "--targets" in e.value.details()
        with grpc.insecure_channel(router) as ch:
            r = generation_pb2_grpc.GenerationStub(ch).Generate(
                chat(CHAT_PROMPTS[0], max_tokens=GREEDY_TOKENS, temperature=0), timeout=120)
            assert list(r.choices[0].token_ids) == hf_greedy[0]
            assert r.spec.draft_tokens == 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)


def test_draft_dying_mid_request_is_invisible_to_the_client(spec_stack, hf_greedy):
    with grpc.insecure_channel(spec_stack["router"]) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        stream = stub.GenerateStream(chat(CHAT_PROMPTS[1], max_tokens=GREEDY_TOKENS, temperature=0), timeout=120)
        ids = list(next(stream).choices[0].token_ids)
        spec_stack["procs"]["draft"].kill()
        for msg in stream:
            for c in msg.choices:
                ids.extend(c.token_ids)
        assert ids == hf_greedy[1]
    with grpc.insecure_channel(spec_stack["target"]) as ch:
        load = target_pb2_grpc.TargetStub(ch).Load(target_pb2.LoadRequest(), timeout=10)
        assert load.kv_blocks_used == 0


def test_target_dying_mid_request_gives_unavailable_promptly(spec_stack):
    """Last in this module: it kills the target. The draft's Verify stream breaks, the router's attempt to attach
    on the target fails too, and the client gets UNAVAILABLE (not a hang until the deadline)."""
    spec_stack["procs"]["draft"] = spawn(["draft", "--address", spec_stack["draft"], "--proposer", "ngram"],
                                         open("/dev/null", "w"))           # the previous test killed it
    wait_healthy(spec_stack["draft"])
    with grpc.insecure_channel(spec_stack["router"]) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        stream = stub.GenerateStream(chat(CHAT_PROMPTS[2], max_tokens=400, temperature=0, ignore_eos=True),
                                     timeout=120)
        first = next(stream)
        assert first.choices[0].token_ids
        t0 = time.monotonic()
        spec_stack["procs"]["target"].kill()
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert time.monotonic() - t0 < 10
