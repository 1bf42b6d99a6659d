"""API keys and per-caller limits: parsing the keys file, the bearer check, limits and their error codes."""
from __future__ import annotations

import grpc
import pytest

from services.router.auth import KeyTable
from services.router.config import RouterConfig
from services.router.limits import Caller, Limits
from shared.errors import InvalidRequest, Overloaded, Unauthenticated
from shared.rpc.errors import status_for

KEYS = """
defaults:
  max_n: 4
  max_concurrent_requests: 2
keys:
  - name: alice
    key: sk-alice-0123
    max_tokens: 64
    max_n: 8            # looser than the defaults: the defaults win
  - key: "  sk-bob-4567  "
    max_prompt_tokens: 100
    max_concurrent_requests: 1
"""


def table(tmp_path, text: str = KEYS, **cfg) -> KeyTable:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return KeyTable.from_config(RouterConfig(api_keys_file=str(path), **cfg))


def test_keys_file_limits_are_the_strictest_of_flags_defaults_and_key(tmp_path):
    keys = table(tmp_path, max_output_tokens=32, max_prompt_tokens=500)
    alice = keys.authenticate("Bearer sk-alice-0123")
    bob = keys.authenticate("bearer sk-bob-4567")           # scheme in any case; the key's spaces are trimmed
    assert (alice.name, alice.limits) == ("alice", Limits(500, 32, 4, 2))
    assert (bob.name, bob.limits) == ("key #1", Limits(100, 32, 4, 1))
    assert keys.required and keys.anonymous is None


def test_with_several_keys_none_may_hold_more_than_half_the_router(tmp_path):
    text = "keys:\n  - {name: alice, key: sk-a-0123}\n  - {name: bob, key: sk-b-4567, max_concurrent_requests: 3}\n"
    keys = table(tmp_path, text, max_concurrent_requests=10)
    assert keys.authenticate("Bearer sk-a-0123").limits.max_concurrent_requests == 5
    assert keys.authenticate("Bearer sk-b-4567").limits.max_concurrent_requests == 3      # its own is stricter
    one = table(tmp_path, "keys:\n  - {key: sk-a-0123}\n", max_concurrent_requests=10)
    assert one.authenticate("Bearer sk-a-0123").limits.max_concurrent_requests is None   # alone: the router's


def test_single_key_option_and_no_keys(tmp_path):
    keys = KeyTable.from_config(RouterConfig(api_key="sk-one", max_n=3))
    assert keys.authenticate("Bearer sk-one").limits == Limits(None, None, 3, None)
    with pytest.raises(Unauthenticated):
        keys.authenticate("Bearer sk-two")
    both = table(tmp_path, api_key="sk-one")
    assert {both.authenticate("Bearer sk-one").name, both.authenticate("Bearer sk-alice-0123").name} == \
        {"api-key", "alice"}
    open_ = KeyTable.from_config(RouterConfig(max_prompt_tokens=10))
    anyone = open_.authenticate(None)
    assert not open_.required and anyone is open_.authenticate("Bearer whatever")   # no keys: no check
    assert anyone.limits == Limits(10, None, 16, None)


@pytest.mark.parametrize("header, missing", [(None, True), ("", True), ("sk-alice-0123", False),
                                             ("Basic sk-alice-0123", False), ("Bearer ", False),
                                             ("Bearer sk-alice-012", False), ("Bearer sk-alice-01234", False),
                                             ("Bearer sk-älice", False)])
def test_missing_or_wrong_keys_are_unauthenticated(tmp_path, header, missing):
    with pytest.raises(Unauthenticated) as e:
        table(tmp_path).authenticate(header)
    assert e.value.missing is missing
    assert status_for(e.value)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert "sk-" not in str(e.value)                        # the message never echoes a key


@pytest.mark.parametrize("text, words", [
    ("keys: [{name: x}]", "non-empty string 'key'"),
    ("keys: [{key: ''}]", "non-empty string 'key'"),
    ("keys: [{key: a, max_token: 5}]", "unknown limit(s) ['max_token']"),
    ("keys: [{key: a, max_n: 0}]", "max_n must be a positive integer"),
    ("keys: [{key: a, max_n: 'two'}]", "max_n must be a positive integer"),
    ("defaults: {max_n: -1}\nkeys: [{key: a}]", "defaults: max_n must be"),
    ("keys: [{key: a}, {key: a}]", "listed twice"),
    ("keys: []", "lists no keys"),
    ("key: [a]", "expected a mapping"),
    ("keys: {a: 1}", "keys must be a list"),
    ("keys: [", "cannot read"),
])
def test_bad_keys_files_fail_at_start_up(tmp_path, text, words):
    with pytest.raises(ValueError) as e:
        table(tmp_path, text)
    assert words in str(e.value)


def test_missing_keys_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        KeyTable.from_config(RouterConfig(api_keys_file=str(tmp_path / "none.yaml")))


def test_request_size_limits_are_invalid_argument():
    c = Caller("alice", Limits(max_prompt_tokens=10, max_tokens=20, max_n=2))
    c.check(10, 20, 2)
    c.check(10, None, 1)                                    # unset max_tokens: the frontend caps it
    cases = [((11, 5, 1), "shorten it by at least 1 tokens"), ((5, 21, 1), "ask for at most 20"),
             ((5, 5, 3), "ask for at most 2 choices")]
    for args, words in cases:
        with pytest.raises(InvalidRequest) as e:
            c.check(*args)
        assert words in str(e.value) and "'alice'" in str(e.value)
        assert status_for(e.value)[0] is grpc.StatusCode.INVALID_ARGUMENT


def test_concurrency_slots_are_per_caller_and_released_on_errors():
    a, b = Caller("a", Limits(max_concurrent_requests=2)), Caller("b", Limits(max_concurrent_requests=1))
    with a.admitted(), a.admitted(), b.admitted():
        with pytest.raises(Overloaded) as e:
            with a.admitted():
                pass
        assert "already has 2 requests in flight" in str(e.value)
        assert status_for(e.value)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (a.in_flight, b.in_flight) == (2, 1)
    with pytest.raises(RuntimeError):
        with a.admitted():
            raise RuntimeError("the target died")
    assert (a.in_flight, b.in_flight) == (0, 0)
    unlimited = Caller("", Limits())
    with unlimited.admitted(), unlimited.admitted(), unlimited.admitted():
        assert unlimited.in_flight == 3


def test_http_errors_have_openais_401_body():
    from services.router.openai_api import error_response

    code, r = error_response(Unauthenticated("incorrect API key provided"))
    assert (code, r.status_code, r.headers["www-authenticate"]) == (grpc.StatusCode.UNAUTHENTICATED, 401, "Bearer")
    assert r.body == (b'{"error":{"message":"incorrect API key provided","type":"invalid_request_error",'
                      b'"param":null,"code":"invalid_api_key"}}')
    _, r = error_response(Unauthenticated("no API key given", missing=True))
    assert b'"code":null' in r.body
    assert [error_response(e)[1].status_code for e in (Overloaded("x"), InvalidRequest("y"))] == [429, 400]


def test_requests_and_tokens_per_minute_with_the_wait_to_retry():
    from services.router.limits import Caller, Limits
    from shared.errors import RateLimited
    now = [100.0]
    c = Caller("k", Limits(requests_per_minute=2, tokens_per_minute=100), clock=lambda: now[0])
    c.check_rate(30)
    now[0] += 10
    c.check_rate(30)
    with pytest.raises(RateLimited) as e:                        # a third request within the minute
        c.check_rate(1)
    assert e.value.retry_after_s == pytest.approx(50.0) and "2 requests a minute" in str(e.value)
    now[0] = 160.5                                               # the first request left the window
    c.count_tokens(35)                                           # 30 + 35 in the window, +40 would pass 100
    with pytest.raises(RateLimited, match="100 tokens a minute") as e:
        c.check_rate(40)
    assert e.value.retry_after_s == pytest.approx(9.5)           # when the 30 prompt tokens of 110.0 leave
    c.check_rate(35)
    with pytest.raises(InvalidRequest, match="100 tokens a minute"):
        Caller("k", Limits(tokens_per_minute=100)).check_rate(101)
    free = Caller("", Limits())
    for _ in range(100):
        free.check_rate(10_000)                                  # no limits: nothing counted, nothing refused
    assert not free._admitted and not free._tokens


def test_a_router_that_requires_keys_refuses_to_start_without_one(tmp_path):
    with pytest.raises(ValueError, match="no API key is configured"):
        RouterConfig(require_api_key=True)
    assert KeyTable.from_config(RouterConfig(require_api_key=True, api_key="sk-one")).required
