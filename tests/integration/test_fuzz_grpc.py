"""Fuzzed gRPC request bodies against the running stack: random GenerateRequest fields at random and extreme values,
random bytes, and valid requests with unknown fields. Only OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED may come back
(never INTERNAL, UNKNOWN or a stack trace), and afterwards the stack still serves and holds no KV blocks."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Appended to every fuzzed body: a scalar field met twice takes its last value, so whatever the random part says,
# a request that gets served stops after at most 2 tokens (prompts ask for no more than this either).
SMALL = pb.GenerateRequest(max_tokens=2).SerializeToString()
SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))

u32, i32, u64 = st.integers(0, 2**32 - 1), st.integers(-2**31, 2**31 - 1), st.integers(0, 2**64 - 1)
any_float = st.floats(width=32, allow_nan=True, allow_infinity=True)
text = st.text(min_size=1, max_size=40) | st.sampled_from([" ", "\x00", "<|im_end|>", "\U0001F600" * 30, "a" * 2000])
# Each field is unset, a value the server takes (odd ones included), or anything its type holds, in the ratio 2:5:1,
# so that about a third of the requests reach the target and the rest test the refusals.
FIELDS = {"temperature": (st.floats(0, 2, width=32) | st.just(1e-30), any_float),
          "top_p": (st.floats(0, 1, width=32, exclude_min=True), any_float),
          "top_k": (st.integers(0, 100) | st.integers(0, 2**31 - 1), i32),
          "seed": (st.integers(0, 2**63 - 1), u64), "n": (st.integers(1, 4), u32),
          "beam_width": (st.integers(0, 4), u32), "num_speculative_tokens": (st.integers(0, 16), u32),
          "max_tokens": (st.integers(1, 2), st.sampled_from([0, 8192, 2**31, 2**32 - 1]))}   # never unset: see below
KIND = st.sampled_from(["served"] * 5 + ["unset"] * 2 + ["any"])
ROLES = (st.sampled_from(["system", "user", "assistant", "tool"]), st.sampled_from(["", "robot"]) | st.text())
STOPS = (st.lists(text, max_size=3), st.lists(text, min_size=17, max_size=20))
SALTS = (st.text(max_size=40), st.just("s" * 257))


def pick(draw, served, anything):
    """One served value or, one time in eight, anything."""
    return draw(anything if draw(st.sampled_from([False] * 7 + [True])) else served)


@st.composite
def requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    shape = pick(draw, st.sampled_from(["prompt", "messages"]), st.sampled_from(["both", "neither", "empty"]))
    if shape in ("prompt", "both"):
        req.prompt = draw(text)
    if shape in ("messages", "both", "empty"):
        for _ in range(draw(st.integers(1, 3))):
            req.messages.add(role=pick(draw, *ROLES), content="" if shape == "empty" else draw(text))
    for name, (served, anything) in FIELDS.items():
        kind = draw(KIND)
        if kind != "unset" or name == "max_tokens":      # unset max_tokens = the whole context window: too slow
            setattr(req, name, draw(anything if kind == "any" else served))
    req.stop.extend(pick(draw, *STOPS))
    req.request_id, req.cache_salt = draw(st.text()), pick(draw, *SALTS)
    req.ignore_eos = draw(st.booleans())
    return req


@st.composite
def mutated(draw) -> bytes:
    """A valid request's bytes with a random slice replaced by random bytes (parses more often than pure noise)."""
    body = pb.GenerateRequest(prompt=draw(st.text(min_size=1, max_size=20)), max_tokens=1).SerializeToString()
    start = draw(st.integers(0, len(body)))
    end = draw(st.integers(start, len(body)))
    return body[:start] + draw(st.binary(max_size=8)) + body[end:]


def _unknown_field(number: int, payload: bytes) -> bytes:
    """An encoded field the schema does not know (wire type 2: length-delimited)."""
    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield ch


def _call(channel, body: bytes, stream: bool) -> grpc.StatusCode:
    """Sends raw bytes as a request; the status the server answers."""
    method = "/upesi.v1.Generation/" + ("GenerateStream" if stream else "Generate")
    try:
        if stream:
            for _ in channel.unary_stream(method)(body, timeout=120):
                pass
        else:
            channel.unary_unary(method)(body, timeout=120)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code in ALLOWED, f"{code}: {e.details()}"
        assert "Traceback" not in (e.details() or "") and "Exception" not in (e.details() or ""), e.details()
    event(code.name)
    return code


@SETTINGS
@given(req=requests(), stream=st.booleans())
def test_fuzzed_requests_get_ok_or_invalid_argument(channel, req, stream):
    _call(channel, req.SerializeToString() + SMALL, stream)


@SETTINGS
@given(body=st.binary(max_size=300) | mutated(), stream=st.booleans())
def test_random_bytes_get_ok_or_invalid_argument(channel, body, stream):
    body += SMALL
    try:
        pb.GenerateRequest.FromString(body)
        body += SMALL              # it parses, so this starts a new field: SMALL was maybe inside a random one
    except Exception:
        event("does not parse")
    _call(channel, body, stream)


@SETTINGS
@given(number=st.integers(max(f.number for f in pb.GenerateRequest.DESCRIPTOR.fields) + 1, 2**29 - 1),
       payload=st.binary(max_size=50), stream=st.booleans())
def test_unknown_fields_are_ignored(channel, number, payload, stream):
    body = pb.GenerateRequest(prompt="Hi", max_tokens=1, temperature=0).SerializeToString()
    assert _call(channel, body + _unknown_field(number, payload), stream) is grpc.StatusCode.OK


def test_not_a_message_is_invalid_argument(channel):
    for body in (b"\xff\xff\xff", b"\x0a\x02\xff\xfe", b"\x0a\x05ab"):    # corrupt wire format, bad UTF-8
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/upesi.v1.Generation/Generate")(body, timeout=30)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid upesi.v1.GenerateRequest" in e.value.details()


def test_huge_n_is_refused_before_anything_is_sized_by_it(stack, channel):
    """The servicers once built per-choice lists from n before validating it: 2^32 - 1 choices ate the router."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=1, n=2**32 - 1), timeout=30)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "n must be between 1 and" in e.value.details()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "Hi", "max_tokens": 1, "n": 10**12}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(req, timeout=30)
    assert http_error.value.code == 400


def _kv_blocks_used(stack) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
    return int(float(re.search(r"^upesi_kv_blocks_used (\S+)$", text, re.M).group(1)))


def test_still_serving_with_no_kv_blocks_held(stack, channel):
    stub = generation_pb2_grpc.GenerationStub(channel)
    r = stub.Generate(pb.GenerateRequest(prompt="The sky is", max_tokens=4, temperature=0, ignore_eos=True),
                      timeout=120)
    assert len(r.choices[0].token_ids) == 4 and r.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 10
    while (used := _kv_blocks_used(stack)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used == 0
