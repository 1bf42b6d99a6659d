"""The OpenAI-compatible HTTP API through the whole stack: the official openai client, raw HTTP, and fuzzed bodies."""
from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

QUESTION = "Name three colours."
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client(stack):
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(stack) -> str:
    return _get(stack, "/health")["model"]


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield generation_pb2_grpc.GenerationStub(ch)


def _get(stack, path: str, port: int | None = None) -> dict | str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port or stack.http_port}{path}", timeout=30) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def post(stack, path: str, body: dict | bytes) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def assert_error(status: int, raw: bytes, expect: int, words: str = "") -> dict:
    assert status == expect, raw[:500]
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert words in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(model, "model", "upesi")]
    assert client.models.retrieve(model).id == model
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.response.json()["error"]["code"] == "model_not_found"


def test_greedy_chat_equals_grpc_generate(client, model, stub):
    ref = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=QUESTION)], max_tokens=16,
                                           temperature=0), timeout=120).choices[0]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    parts = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        {"type": "text", "text": QUESTION}]}], max_completion_tokens=16, temperature=0)
    assert parts.choices[0].message.content == ref.text


def test_anonymous_callers_get_cached_tokens_only_in_a_partition_of_their_own(client, model):
    """Without API keys every caller shares one partition of the prefix cache, so a repeated prompt's cached_tokens
    would tell anyone whether someone else sent it: the router reports 0 unless the request carries a cache_salt."""
    text = "Summarise the rules of chess for a child who has never played, in one short paragraph. " * 3
    kw = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    shared = [client.chat.completions.create(**kw).usage for _ in range(2)]
    assert shared[1].prompt_tokens >= 48 and shared[1].prompt_tokens_details.cached_tokens == 0
    salted = [client.chat.completions.create(**kw, extra_body={"cache_salt": "mine"}).usage for _ in range(2)]
    assert salted[0].prompt_tokens_details.cached_tokens == 0          # a new partition: nothing cached yet
    assert salted[1].prompt_tokens_details.cached_tokens >= 32


def test_chat_stream_with_usage_adds_up_to_the_whole_answer(client, model):
    kw = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(**kw, stream=True))           # no usage chunk unless asked
    assert all(c.choices for c in plain)


def test_completions_plain_and_streamed_equal_grpc(client, model, stub):
    prompt = "The capital of France is"
    ref = stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=8, temperature=0), timeout=120).choices[0]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    assert client.completions.create(model=model, prompt=[prompt], max_tokens=8, temperature=0).choices[0].text \
        == ref.text
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_cuts_the_text(client, model):
    kw = {"model": model, "prompt": "Count from one to ten, separated by commas:", "max_tokens": 16,
          "temperature": 0}
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 8
    stop = full[4:7]
    r = client.completions.create(**kw, stop=[stop, "never appears"]).choices[0]
    assert (r.text, r.finish_reason) == (full[:full.index(stop)], "stop")
    assert client.completions.create(**kw, stop=stop).choices[0].text == r.text


def test_n_gives_n_choices_plain_and_streamed(client, model):
    kw = {"model": model, "messages": [{"role": "user", "content": "Tell me a fun fact."}], "max_tokens": 8,
          "temperature": 1.0, "seed": 7, "n": 2}
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens <= 16
    seen, texts = set(), {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert (c.delta.role == "assistant") == (c.index not in seen)      # the role comes first, once
            seen.add(c.index)
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]   # seeded: the same samples


def test_a_tiny_temperature_is_greedy_and_leaves_the_engine_alive(client, model):
    kw = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    greedy = client.chat.completions.create(**kw, temperature=0).choices[0].message.content
    for t in (1e-40, 1e-300):                          # 1/t overflows fp32: NaN probabilities once killed the engine
        assert client.chat.completions.create(**kw, temperature=t).choices[0].message.content == greedy


@pytest.mark.parametrize("kw, status, words", [
    ({"temperature": -1}, 400, "temperature"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
    ({"top_logprobs": 2}, 400, "logprobs"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"n": 99}, 400, "n must be"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"frequency_penalty": 3}, 400, "frequency_penalty"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_openai_errors_and_the_stack_keeps_serving(client, model, kw, status, words, stream):
    import openai
    args = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        r = client.chat.completions.create(**args, stream=stream)
        list(r) if stream else None
    assert e.value.status_code == status
    assert_error(e.value.status_code, e.value.response.content, status, words)
    if status == 404:
        assert e.value.response.json()["error"]["code"] == "model_not_found"
    ok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", b"{not json", "JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a"] * 33}, "at most 32"),
    ("/v1/completions", {"prompt": [10**9]}, "token ids"),
    ("/v1/completions", {"prompt": "hi", "suffix": "there"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, "stop"),
])
def test_malformed_bodies_are_400_in_openai_format(stack, path, body, words):
    assert_error(*post(stack, path, body), 400, words)


def _metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_hanging_up_cancels_the_generation(stack, stream):
    target_metrics = int(stack.proc.args[stack.proc.args.index("--target-metrics-port") + 1])
    before = _metric(_get(stack, "/metrics"), "upesi_generation_tokens_total")
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 512,
                                                        "ignore_eos": True, "stream": stream}),
                 {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: {")     # the first token is out
    else:
        time.sleep(1.0)                                           # generating by now
        assert _get(stack, "/health")["in_flight"] == 1
    conn.close()                                                  # hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = _metric(_get(stack, "/metrics", target_metrics), "upesi_running_sequences")
        if _get(stack, "/health")["in_flight"] == 0 and running == 0:
            break
        time.sleep(0.1)
    assert _get(stack, "/health")["in_flight"] == 0
    assert _metric(_get(stack, "/metrics"), "upesi_generation_tokens_total") - before < 512


def test_every_exception_maps_to_an_openai_error():
    from services.router.openai_api import error_body
    from shared.errors import InvalidRequest, Overloaded, PeerUnavailable
    down = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    for exc, status in [(InvalidRequest("bad"), 400), (Overloaded("busy"), 429), (PeerUnavailable("down"), 503),
                        (down, 503), (RuntimeError("secret detail"), 500)]:
        _, http_status, body = error_body(exc)
        assert http_status == status and set(body["error"]) == ERROR_KEYS
    assert "secret detail" not in body["error"]["message"]       # a 500 tells nothing of the server's insides


# Fuzzing: any JSON body gets 200 or a 4xx in OpenAI's format, never a 5xx, and the server keeps serving. A body is
# valid fields with up to two replaced by junk, so both answers and refusals are exercised; valid max_tokens stay <= 4.
_junk = st.one_of(st.none(), st.booleans(), st.integers(max_value=-1), st.integers(min_value=2**40), st.floats(),
                  st.text(max_size=12), st.lists(st.integers(-3, 3), max_size=3),
                  st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_valid = {
    "model": st.just("SERVED"), "n": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 60000), "seed": st.integers(0, 2**63 - 1), "user": st.text(max_size=8),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=4)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "logprobs": st.sampled_from([None, 0]),
    "presence_penalty": st.just(0), "surprise": st.text(max_size=4),
}
_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)})
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                  "content": st.one_of(st.text(max_size=40), st.lists(_part, max_size=2))})
_chat = {"messages": st.lists(_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 4),
         "max_completion_tokens": st.integers(1, 4)}
_completion = {"prompt": st.one_of(st.text(min_size=1, max_size=60), st.lists(st.text(min_size=1, max_size=20),
                                                                             min_size=1, max_size=1)),
               "max_tokens": st.integers(1, 4)}


@st.composite
def _bodies(draw, required: dict) -> dict:
    body = draw(st.fixed_dictionaries(required, optional=_valid))
    names = sorted(body) + ["messages" if "messages" in required else "prompt"]
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        if name != "max_tokens":                        # junk there could be a valid, long request
            body[name] = draw(_junk)
    return body


def _check_any(stack, model: str, path: str, body: dict) -> None:
    if body.get("model") == "SERVED":
        body["model"] = model
    status, raw = post(stack, path, json.dumps(body).encode())        # NaN and Infinity make invalid JSON
    assert status == 200 or 400 <= status < 500, (status, raw[:500])
    event(f"HTTP {status}")                               # pytest --hypothesis-show-statistics shows the mix
    if status != 200:
        assert_error(status, raw, status)
    elif body.get("stream") is True:
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        assert not any(e.startswith('data: {"error"') for e in events), events
    else:
        assert json.loads(raw)["choices"]


@settings(max_examples=30, deadline=None, database=None)
@given(body=_bodies(_chat))
def test_fuzzed_chat_bodies_never_get_a_5xx(stack, model, body):
    _check_any(stack, model, "/v1/chat/completions", body)


@settings(max_examples=15, deadline=None, database=None)
@given(body=_bodies(_completion))
def test_fuzzed_completion_bodies_never_get_a_5xx(stack, model, body):
    _check_any(stack, model, "/v1/completions", body)


def test_still_serving_after_everything(stack, client, model):
    assert _get(stack, "/health")["in_flight"] == 0
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    assert len(r.choices) == 1
