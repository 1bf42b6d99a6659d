"""The whole stack as a user runs it (`upesi serve`): real processes, real gRPC, the default model."""
from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request

import grpc
import pytest

from tests.conftest import CHAT_PROMPTS, GREEDY_TOKENS
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


def chat(text: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], **kw)


def test_greedy_through_the_stack_matches_transformers(stub, hf_greedy):
    for prompt, ref in zip(CHAT_PROMPTS, hf_greedy):
        r = stub.Generate(chat(prompt, max_tokens=GREEDY_TOKENS, temperature=0), timeout=120)
        assert list(r.choices[0].token_ids) == ref
        assert r.usage.completion_tokens == len(ref)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_stream_pieces_add_up_to_the_unary_answer(stub):
    req = chat("Name three colours.", max_tokens=32, temperature=0)
    whole = stub.Generate(req, timeout=60).choices[0]
    msgs = list(stub.GenerateStream(req, timeout=60))
    assert "".join(c.text for m in msgs for c in m.choices) == whole.text
    assert [t for m in msgs for c in m.choices for t in c.token_ids] == list(whole.token_ids)
    assert msgs[-1].usage.completion_tokens == len(whole.token_ids)
    assert msgs[-1].choices[-1].finish_reason == whole.finish_reason


PROMPTS8 = ["What is the capital of Italy?", "Give me a synonym for happy.", "Count from one to ten.",
            "Why is the sky blue?", "Write a haiku about rain.", "What is 12 times 12?",
            "Describe a cat in one sentence.", "Translate 'good morning' to French."]


def test_concurrent_requests_equal_alone(stub):
    alone = [list(stub.Generate(chat(p, max_tokens=24, temperature=0), timeout=60).choices[0].token_ids)
             for p in PROMPTS8]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: list(stub.Generate(chat(p, max_tokens=24, temperature=0),
                                                            timeout=120).choices[0].token_ids), PROMPTS8))
    assert together == alone


def test_seeded_sampling_is_reproducible_and_n_gives_n_choices(stub):
    req = chat("Tell me a fun fact.", max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, n=3)
    a, b = stub.Generate(req, timeout=60), stub.Generate(req, timeout=60)
    assert len(a.choices) == 3
    assert [list(c.token_ids) for c in a.choices] == [list(c.token_ids) for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) > 1        # different seeds per choice
    # choice i uses seed + i: choice 1 of seed 1234 is choice 0 of seed 1235
    single = stub.Generate(chat("Tell me a fun fact.", max_tokens=24, temperature=1.0, top_p=0.95, seed=1235),
                           timeout=60)
    assert list(single.choices[0].token_ids) == list(a.choices[1].token_ids)


def test_stop_string_cuts_the_text(stub):
    full = stub.Generate(chat("Count from one to ten, separated by commas.", max_tokens=40, temperature=0),
                         timeout=60).choices[0].text
    assert len(full) > 12
    stop = full[5:9]                                   # likely spans token boundaries
    r = stub.Generate(chat("Count from one to ten, separated by commas.", max_tokens=40, temperature=0,
                           stop=[stop]), timeout=60).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == full[:full.index(stop)]


@pytest.mark.parametrize("req, words", [
    (pb.GenerateRequest(), "no prompt and no messages"),
    (pb.GenerateRequest(prompt="hi", max_tokens=0), "max_tokens"),
    (pb.GenerateRequest(prompt="hi", temperature=-0.5), "temperature"),
    (pb.GenerateRequest(prompt="hi", top_p=0.0), "top_p"),
    (pb.GenerateRequest(prompt="hi", top_p=1.5), "top_p"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]), "role"),
    (pb.GenerateRequest(prompt="hello " * 9000), "context window"),
])
def test_bad_input_is_invalid_argument_and_the_stack_keeps_serving(stub, req, words):
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in e.value.details()
        assert "Traceback" not in e.value.details()
    ok = stub.Generate(pb.GenerateRequest(prompt="The sky is", max_tokens=2, temperature=0), timeout=60)
    assert len(ok.choices[0].token_ids) == 2


def test_health_reflection_and_http(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(stack.address) as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="upesi.v1.Generation"))
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"upesi.v1.Generation", "grpc.health.v1.Health"} <= names
    base = f"http://127.0.0.1:{stack.http_port}"
    assert json.load(urllib.request.urlopen(base + "/health"))["status"] == "ok"
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    assert "upesi_requests_total" in text and "upesi_time_to_first_token_seconds" in text


def test_beam_search_through_the_stack_equals_in_process(stub, engine, chat_prompt_ids):
    from shared.sampling_params import SamplingParams
    r = stub.Generate(chat(CHAT_PROMPTS[3], max_tokens=12, temperature=0, beam_width=3), timeout=120)
    local = engine.generate([chat_prompt_ids[3]], SamplingParams(temperature=0, max_tokens=12, beam_width=3))[0][0]
    assert list(r.choices[0].token_ids) == local
    assert r.choices[0].finish_reason in ("stop", "length")


def test_upesi_generate_prints_the_answer_then_its_usage(stack):
    import subprocess
    import sys

    from tests.conftest import ROOT
    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--address", stack.address,
                          "--max-tokens", "12", "Name three colours."], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and out.stdout.endswith("\n") and not out.stdout.startswith("\n")
    assert out.stderr.strip().splitlines()[-1].endswith("completion tokens]")
    assert not out.stderr.startswith("\n")


def test_the_openai_api_serves_a_clean_model_name(stack):
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/v1/models", timeout=30) as r:
        models = json.load(r)["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]


def test_the_running_router_has_not_loaded_torch(stack):
    """The router only tokenises and routes: its process maps no libtorch (the target's does)."""
    import pathlib
    children = pathlib.Path(f"/proc/{stack.proc.pid}/task/{stack.proc.pid}/children").read_text().split()
    maps = {}
    for pid in children:
        cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        role = cmd[3].decode() if len(cmd) > 3 else ""           # python -m services.cli ROLE ...
        maps[role] = pathlib.Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" in maps["target"]
    assert "libtorch" not in maps["router"]
