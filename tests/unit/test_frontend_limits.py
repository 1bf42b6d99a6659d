"""The router's Frontend with stand-in target replicas: the server-side deadline, beams counted as choices, the
prompt-size bound before tokenising, and a request moved to another replica when its first one is unavailable."""
from __future__ import annotations

import asyncio
import functools

import pytest

from services.router.config import RouterConfig
from services.router.frontend import Frontend, GenerationInput
from services.router.target_client import StepOutput, TargetInfo
from shared.errors import InvalidRequest, PeerUnavailable


@functools.cache
def tokenizer():
    from shared.model_files import default_model_path
    from shared.tokenizer import Tokenizer
    return Tokenizer(default_model_path())


class FakeTarget:
    """Answers one token and "length", or fails with PeerUnavailable before answering."""

    def __init__(self, address: str, fail: bool = False) -> None:
        self.address, self.fail, self.up, self.timeouts = address, fail, True, []

    async def generate(self, request_id, prompt, params, timeout, attach=False):
        self.timeouts.append(timeout)
        if self.fail:
            self.up = False
            raise PeerUnavailable(f"target {self.address} is unavailable: connection refused")
        yield StepOutput([(0, [42], "length", None, None)], {}, len(prompt), 0)


def frontend(targets: list[FakeTarget], **cfg) -> Frontend:
    info = TargetInfo("m", 1024, 49152, [0], 16)
    return Frontend(RouterConfig(**cfg), tokenizer(), targets, info)


async def run(f: Frontend, inp: GenerationInput, timeout: float | None = None) -> list:
    return [c async for c in f.stream(inp, timeout)]


def test_every_request_has_a_deadline():
    t = FakeTarget("a")
    f = frontend([t], request_timeout_s=30)
    asyncio.run(run(f, GenerationInput(prompt="Hello", max_tokens=1)))
    asyncio.run(run(f, GenerationInput(prompt="Hello", max_tokens=1), timeout=5.0))
    asyncio.run(run(f, GenerationInput(prompt="Hello", max_tokens=1), timeout=100.0))
    bounds = [(29, 30), (4, 5.0), (29, 30)]                       # the time left of one deadline each
    assert len(t.timeouts) == 3
    assert all(lo < left <= hi for (lo, hi), left in zip(bounds, t.timeouts)), t.timeouts


def test_beams_count_as_choices_and_long_prompts_stop_before_tokenising(monkeypatch):
    f = frontend([FakeTarget("a")], max_n=4)
    with pytest.raises(InvalidRequest, match="beam_width must be at most 4"):
        asyncio.run(run(f, GenerationInput(prompt="Hi", max_tokens=1, beam_width=5)))
    monkeypatch.setattr(f.tok, "encode", lambda text: pytest.fail("tokenised a prompt over the bound"))
    with pytest.raises(InvalidRequest, match="at most 32768"):
        asyncio.run(run(f, GenerationInput(prompt="x" * (32 * 1024 + 1), max_tokens=1)))


def test_an_unavailable_replica_is_skipped_and_marked_down():
    dead, alive = FakeTarget("a", fail=True), FakeTarget("b")
    f = frontend([dead, alive])
    chunks = asyncio.run(run(f, GenerationInput(prompt="Hello", max_tokens=1)))
    assert chunks[-1].done and chunks[-1].completion_tokens == 1
    assert len(dead.timeouts) == 1 and len(alive.timeouts) == 1
    asyncio.run(run(f, GenerationInput(prompt="Hello again", max_tokens=1)))
    assert len(dead.timeouts) == 1 and len(alive.timeouts) == 2     # a replica marked down is not tried again
    assert f.in_flight == 0 and f.load == {"a": 0, "b": 0}
    only_dead = frontend([FakeTarget("c", fail=True)])
    with pytest.raises(PeerUnavailable):
        asyncio.run(run(only_dead, GenerationInput(prompt="Hello", max_tokens=1)))


def test_a_real_client_marks_an_unreachable_replica_down():
    """TargetClient against a port nothing listens on: UNAVAILABLE becomes PeerUnavailable, and the replica is
    down for its hold-off."""
    from services.router.target_client import TargetClient
    from shared.sampling_params import SamplingParams
    from tests.conftest import free_port

    async def go() -> TargetClient:
        client = TargetClient(f"127.0.0.1:{free_port()}", retry_after_s=60)
        assert client.up
        with pytest.raises(PeerUnavailable, match="is unavailable"):
            async for _ in client.generate("r", [1, 2], SamplingParams(max_tokens=1), timeout=10):
                pass
        await client.close()
        return client

    assert not asyncio.run(go()).up


def test_an_unset_max_tokens_gets_the_default_within_the_callers_cap_and_the_context():
    from services.router.limits import Caller, Limits

    def given(inp: GenerationInput, caller_cap: int | None = None, **cfg) -> int:
        return frontend([FakeTarget("a")], **cfg).prepare(inp, Caller("c", Limits(None, caller_cap, 4)))[1].max_tokens

    room = 1024 - len(tokenizer().encode("Hello"))                      # the stand-in context window is 1,024
    assert given(GenerationInput(prompt="Hello"), default_max_tokens=100) == 100
    assert given(GenerationInput(prompt="Hello"), caller_cap=50, default_max_tokens=100) == 50
    assert given(GenerationInput(prompt="Hello"), default_max_tokens=5000) == room
    assert given(GenerationInput(prompt="Hello"), default_max_tokens=0) == room         # 0: the rest, as vLLM
    assert given(GenerationInput(prompt="Hello", max_tokens=700), default_max_tokens=100) == 700
    with pytest.raises(ValueError, match="default_max_tokens"):
        RouterConfig(default_max_tokens=-1)
