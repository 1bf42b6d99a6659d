"""API keys and per-key limits through the whole stack (one stack for every check): gRPC metadata and HTTP bearer
keys, 401 / UNAUTHENTICATED, request-size limits (400 / INVALID_ARGUMENT), a per-key concurrency limit
(429 / RESOURCE_EXHAUSTED) that leaves other keys alone, and open health, reflection, /health and /metrics."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

SMALL, OTHER, RATED = "sk-small-7f3a9c", "sk-other-18be42", "sk-rated-5d2e60"
KEYS = f"""
defaults:
  max_concurrent_requests: 1
keys:
  - name: small
    key: {SMALL}
    max_tokens: 8
    max_n: 2
    max_prompt_tokens: 48
  - name: other
    key: {OTHER}
  - name: rated
    key: {RATED}
    requests_per_minute: 2
"""
QUESTION = [pb.ChatMessage(role="user", content="Name a colour.")]
INTERNAL = "internal-token-for-this-test-0451"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "keys.yaml").write_text(KEYS)
    with pytest.MonkeyPatch.context() as mp:          # `upesi serve` hands its environment to the router
        mp.setenv("UPESI_API_KEYS_FILE", str(tmp / "keys.yaml"))
        mp.setenv("UPESI_INTERNAL_TOKEN", INTERNAL)       # known here: `upesi serve` keeps a token set beforehand
        s = Stack(tmp)
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def http(stack, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}", headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    return status, (raw if path == "/metrics" else json.loads(raw))


def grpc_code(call, req: pb.GenerateRequest, key: str | None) -> tuple[grpc.StatusCode, str]:
    try:
        result = call(req, metadata=bearer(key) if key else None, timeout=120)
        if not isinstance(result, pb.GenerateResponse):     # a stream: read it to the end
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_no_key_or_a_wrong_key_is_refused(stack, stub):
    req = pb.GenerateRequest(messages=QUESTION, max_tokens=2)
    for key in (None, "sk-wrong", SMALL + "x"):
        for call in (stub.Generate, stub.GenerateStream):
            code, details = grpc_code(call, req, key)
            assert code is grpc.StatusCode.UNAUTHENTICATED and "key" in details
        status, body = http(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, key)
        assert status == 401 and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["code"] == (None if key is None else "invalid_api_key")
        assert http(stack, "/v1/models", key=key)[0] == 401
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="x", prompt="Hi", max_tokens=2)


def test_health_reflection_health_page_and_metrics_stay_open(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    with grpc.insecure_channel(stack.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "upesi.v1.Generation" in ProtoReflectionDescriptorDatabase(ch).get_services()
    assert http(stack, "/health")[0] == 200
    status, text = http(stack, "/metrics")
    assert status == 200 and "upesi_requests_total" in text and SMALL not in text


def test_the_right_key_is_served_by_the_openai_client_and_grpc(stack, stub):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=SMALL, max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=6, temperature=0)
    r = stub.Generate(pb.GenerateRequest(messages=QUESTION, max_tokens=6, temperature=0), metadata=bearer(SMALL),
                      timeout=120)
    assert chat.choices[0].message.content == r.choices[0].text and r.usage.completion_tokens > 0
    streamed = stub.GenerateStream(pb.GenerateRequest(messages=QUESTION, max_tokens=6, temperature=0),
                                   metadata=bearer(OTHER), timeout=120)
    assert "".join(c.text for m in streamed for c in m.choices) == r.choices[0].text


def test_per_key_request_size_limits(stack, stub):
    long_prompt = "one two three four five six seven eight nine ten " * 10         # about 100 tokens
    cases = [(dict(max_tokens=9), "ask for at most 8"), (dict(max_tokens=2, n=3), "at most 2 choices"),
             (dict(max_tokens=2, prompt=long_prompt), "shorten it by at least")]
    for kw, words in cases:
        req = pb.GenerateRequest(**{"messages": [] if "prompt" in kw else QUESTION, **kw})
        code, details = grpc_code(stub.Generate, req, SMALL)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and words in details and "'small'" in details, details
        assert grpc_code(stub.Generate, req, OTHER)[0] is grpc.StatusCode.OK      # the other key has no such limit
        body = {"prompt": kw.get("prompt", "Hi"), "max_tokens": kw["max_tokens"], "n": kw.get("n", 1)}
        status, answer = http(stack, "/v1/completions", body, SMALL)
        assert status == 400 and words in answer["error"]["message"], answer
    # Unset max_tokens is capped to the key's limit instead of the rest of the context window.
    r = stub.Generate(pb.GenerateRequest(prompt="Count: 1, 2, 3,", ignore_eos=True), metadata=bearer(SMALL),
                      timeout=120)
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_concurrency_limit_is_per_key(stack, stub):
    req = pb.GenerateRequest(prompt="Count to a thousand:", max_tokens=400, ignore_eos=True, temperature=0)
    open_stream = stub.GenerateStream(req, metadata=bearer(OTHER), timeout=300)
    try:
        next(open_stream)                                    # OTHER's one slot is now taken
        code, details = grpc_code(stub.Generate, pb.GenerateRequest(prompt="Hi", max_tokens=1), OTHER)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "'other' already has 1 requests in flight" in details
        status, body = http(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, OTHER)
        assert status == 429 and body["error"]["type"] == "rate_limit_error", body
        assert grpc_code(stub.Generate, pb.GenerateRequest(prompt="Hi", max_tokens=1), SMALL)[0] is grpc.StatusCode.OK
        assert http(stack, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, SMALL)[0] == 200
    finally:
        open_stream.cancel()
    deadline = time.monotonic() + 30                         # the cancel reaches the router, which frees the slot
    while (code := grpc_code(stub.Generate, pb.GenerateRequest(prompt="Hi", max_tokens=1), OTHER)[0]) \
            is grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code is grpc.StatusCode.OK


def test_each_key_has_its_own_prefix_cache(stub):
    """The same prompt (about 40 tokens: two full blocks) with the same client salt: a key's repeat is served from
    its cache, another key's first request is not, so cached_tokens says nothing about what others sent."""
    prompt = ("Partition check seven: list the planets of the solar system in order from the sun, one per line, "
              "with each planet's number of known moons and one fact about it.")
    req = pb.GenerateRequest(prompt=prompt, max_tokens=1, temperature=0, cache_salt="shared-salt")

    def cached(key: str) -> int:
        return stub.Generate(req, metadata=bearer(key), timeout=120).usage.cached_tokens

    first = stub.Generate(req, metadata=bearer(OTHER), timeout=120).usage
    assert 32 <= first.prompt_tokens <= 48 and first.cached_tokens == 0
    assert cached(OTHER) >= 32                               # the key's own repeat hits
    assert cached(SMALL) == 0                                # another key's first request does not
    assert cached(SMALL) >= 32


def test_size_limits_refuse_before_reading_or_tokenising(stack, stub):
    """A body over --max-request-bytes (4 MiB) gets 413 by its Content-Length, unread (without a key: 401, also
    unread), a gRPC message over it RESOURCE_EXHAUSTED; a prompt over 32 characters per context token is refused
    before tokenising; the health page answers meanwhile."""
    big = json.dumps({"prompt": "x" * (5 * 2**20), "max_tokens": 1}).encode()
    t0 = time.monotonic()
    assert http_raw(stack, "/v1/completions", big)[0] == 401
    status, body = http_raw(stack, "/v1/completions", big, OTHER)
    assert status == 413 and body["error"]["code"] == "request_too_large" and "4194304" in body["error"]["message"]
    assert time.monotonic() - t0 < 30
    assert http(stack, "/health")[0] == 200
    code, details = grpc_code(stub.Generate, pb.GenerateRequest(prompt="y" * (5 * 2**20), max_tokens=1), OTHER)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
    window = 8192                                            # the default model's context window
    long = "z " * (16 * window + 1)                          # within 4 MiB, over 32 characters per token
    code, details = grpc_code(stub.Generate, pb.GenerateRequest(prompt=long, max_tokens=1), OTHER)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and f"at most {32 * window}" in details, details
    status, body = http(stack, "/v1/completions", {"prompt": long, "max_tokens": 1}, OTHER)
    assert status == 400 and "characters" in body["error"]["message"], body


def http_raw(stack, path: str, data: bytes, key: str | None = None) -> tuple[int, dict]:
    """POSTs the headers and the first 64 KiB of data, then reads the answer: a server that refuses the body by
    its Content-Length answers without waiting for the rest."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        if key:
            conn.putheader("Authorization", f"Bearer {key}")
        conn.endheaders(data[:65536])
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_the_target_serves_only_the_deployment(stack):
    """The target's port answers Generate and Abort only with the deployment's internal token (the router has it);
    Info, Load and health stay open; a wrong token is refused like none."""
    from upesi.v1 import target_pb2, target_pb2_grpc
    port = next(int(line.split(" on 127.0.0.1:")[1]) for line in stack.log.read_text().splitlines()
                if "serving upesi.v1.Target on" in line)
    req = target_pb2.TargetGenerateRequest(request_id="outsider", prompt_token_ids=[1, 2, 3],
                                           sampling=target_pb2.SamplingParams(max_tokens=2, top_p=1.0,
                                                                              ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = target_pb2_grpc.TargetStub(ch)
        for metadata in (None, [("x-upesi-internal-token", "a-guess")]):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=metadata, timeout=60))
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.Abort(target_pb2.AbortRequest(request_id="x"), metadata=metadata, timeout=60)
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert stub.Load(target_pb2.LoadRequest(), timeout=60).kv_blocks_total > 0
        assert stub.Info(target_pb2.InfoRequest(), timeout=60).max_model_len > 0
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        out = list(stub.Generate(req, metadata=[("x-upesi-internal-token", INTERNAL)], timeout=60))
        assert sum(len(d.token_ids) for m in out for d in m.deltas) == 2


def test_requests_per_minute_get_429_with_retry_after_and_leave_other_keys_alone(stack):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for _ in range(2):
        assert http(stack, "/v1/chat/completions", body, RATED)[0] == 200
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/chat/completions", data=json.dumps(
        body).encode(), headers={"Content-Type": "application/json", "Authorization": f"Bearer {RATED}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    assert e.value.code == 429 and 1 <= int(e.value.headers["Retry-After"]) <= 60
    assert "2 requests a minute" in json.loads(e.value.read())["error"]["message"]
    assert http(stack, "/v1/chat/completions", body, OTHER)[0] == 200
