"""Per-caller request limits: prompt length, max_tokens, n, requests in flight, requests and tokens per minute.

The router's own flags are hard caps for every caller; an API keys file (see auth.py) may tighten them with its
`defaults` and per key. Request-size limits raise InvalidRequest (INVALID_ARGUMENT / HTTP 400); the concurrency limit
raises Overloaded and the rate limits RateLimited (RESOURCE_EXHAUSTED / HTTP 429, with Retry-After). Rates count over
the last 60 s: requests as they are admitted, tokens as prompt tokens at admission plus output tokens as they end.
Every message says what to change.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequest, Overloaded, RateLimited

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Limits:
    """None = no limit of its own (the context window and the router-wide caps still apply)."""
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None          # the largest max_tokens a request may ask for; unset max_tokens is capped
    max_n: int | None = None
    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None   # prompt and output tokens

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")

    @classmethod
    def from_mapping(cls, data: dict[str, Any], where: str) -> Limits:
        """Limits from a YAML mapping; unknown fields are an error, so a typo never loosens a limit silently."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{where}: unknown limit(s) {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def tightened(self, other: Limits) -> Limits:
        """The stricter of the two for every field."""
        def pick(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)
        return Limits(*(pick(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)))


class Caller:
    """Who sent a request (one API key, or everyone when no keys are configured) and what they may ask for."""

    def __init__(self, name: str, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.limits, self.clock = name, limits, clock
        self.in_flight = 0                     # this caller's requests now being served (one event loop: no lock)
        self._admitted: deque[float] = deque()             # when requests were admitted, last 60 s
        self._tokens: deque[tuple[float, int]] = deque()   # (when, tokens), last 60 s
        self.partition = ""                    # this caller's share of the prefix cache ("" = the anonymous one)

    def cache_salt(self, client_salt: str) -> str:
        """The salt a request's KV blocks are hashed with: the caller's partition, then the client's own salt.
        Requests of different API keys never share cached blocks, so `cached_tokens` tells nobody what another
        tenant sent."""
        return f"{self.partition}\x00{client_salt}" if self.partition else client_salt

    def __repr__(self) -> str:
        return f"Caller({self.name!r}, {self.limits})"

    @property
    def who(self) -> str:
        return "this server" if not self.name else f"the API key {self.name!r}"

    def check(self, prompt_tokens: int, max_tokens: int | None, n: int) -> None:
        """Raises InvalidRequest when the request is larger than this caller may ask for."""
        lim = self.limits
        if lim.max_prompt_tokens is not None and prompt_tokens > lim.max_prompt_tokens:
            raise InvalidRequest(f"the prompt has {prompt_tokens} tokens but {self.who} allows at most "
                                 f"{lim.max_prompt_tokens}; shorten it by at least "
                                 f"{prompt_tokens - lim.max_prompt_tokens} tokens")
        if lim.max_tokens is not None and max_tokens is not None and max_tokens > lim.max_tokens:
            raise InvalidRequest(f"max_tokens {max_tokens} is above the limit of {self.who}; "
                                 f"ask for at most {lim.max_tokens}")
        if lim.max_n is not None and n > lim.max_n:
            raise InvalidRequest(f"n (or beam_width) {n} is above the limit of {self.who}; ask for at most "
                                 f"{lim.max_n} choices")

    def check_rate(self, prompt_tokens: int) -> None:
        """Admits a request of prompt_tokens against the per-minute limits (and counts it), or raises RateLimited
        with the wait after which it would pass; InvalidRequest for a prompt no minute can take."""
        lim, now = self.limits, self.clock()
        while self._admitted and now - self._admitted[0] >= WINDOW_S:
            self._admitted.popleft()
        while self._tokens and now - self._tokens[0][0] >= WINDOW_S:
            self._tokens.popleft()
        rpm, tpm = lim.requests_per_minute, lim.tokens_per_minute
        if rpm is not None and len(self._admitted) >= rpm:
            wait = WINDOW_S - (now - self._admitted[0])
            raise RateLimited(f"{self.who} allows {rpm} requests a minute; retry in {math.ceil(wait)} s", wait)
        if tpm is not None:
            if prompt_tokens > tpm:
                raise InvalidRequest(f"the prompt has {prompt_tokens} tokens but {self.who} allows {tpm} tokens "
                                     "a minute; shorten it")
            used, wait = sum(n for _, n in self._tokens), 0.0
            for t, n in self._tokens:                      # the oldest leave first
                if used + prompt_tokens <= tpm:
                    break
                used, wait = used - n, WINDOW_S - (now - t)
            if wait > 0:
                raise RateLimited(f"{self.who} allows {tpm} tokens a minute; retry in {math.ceil(wait)} s", wait)
        if rpm is not None:
            self._admitted.append(now)
        self.count_tokens(prompt_tokens)

    def count_tokens(self, tokens: int) -> None:
        """Adds tokens (a finished request's output) to this minute's count."""
        if tokens and self.limits.tokens_per_minute is not None:
            self._tokens.append((self.clock(), tokens))

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Holds one of this caller's concurrency slots; raises Overloaded when none is free."""
        cap = self.limits.max_concurrent_requests
        if cap is not None and self.in_flight >= cap:
            raise Overloaded(f"{self.who} already has {self.in_flight} requests in flight, its limit; "
                             "wait for one to finish, then retry")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
