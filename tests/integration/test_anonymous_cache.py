"""`--anonymous-prefix-cache private`: callers without an API key share nothing through the prefix cache, so neither
cached_tokens (reported here: --anonymous-cached-tokens) nor the time to the first token can tell one that another
sent the same prefix; a request that brings its own cache_salt still reuses its blocks. A real `upesi serve`."""
from __future__ import annotations

import grpc
import pytest

from tests.conftest import Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = ("Privacy check three: name the largest moon of each planet that has one, in order from the sun, with one "
          "fact about each, one per line, and then say which of those moons a probe has visited and when it did.")


def test_anonymous_requests_reuse_nothing_across_requests(tmp_path):
    s = Stack(tmp_path, ["--anonymous-cached-tokens", "true", "--anonymous-prefix-cache", "private"])
    try:
        s.wait_ready()
        with grpc.insecure_channel(s.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            def usage(salt: str) -> pb.Usage:
                req = pb.GenerateRequest(prompt=PROMPT, max_tokens=1, temperature=0, cache_salt=salt)
                return stub.Generate(req, timeout=120).usage

            first = usage("")
            assert first.prompt_tokens >= 40 and first.cached_tokens == 0
            assert usage("").cached_tokens == 0              # the same prefix again: not served from the cache
            assert usage("mine").cached_tokens == 0
            assert usage("mine").cached_tokens >= 32         # a caller's own salt: its repeat hits
    finally:
        assert s.stop() == 0
